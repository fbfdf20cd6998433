package cpulimit

import (
	"os/exec"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

func TestLimitCPUThrottlesABusyProcess(t *testing.T) {
	busy := exec.Command("sh", "-c", "while :; do :; done")
	if err := busy.Start(); err != nil {
		t.Fatal(err)
	}
	l, err := Apply(busy.Process.Pid, 0.05)
	defer func() {
		busy.Process.Kill()
		busy.Wait()
		if l != nil {
			l.Remove() // only once the process is gone: a cgroup must be empty
		}
	}()
	if err != nil {
		t.Skipf("cannot limit CPU here: %v", err)
	}
	// A spinning shell wants a whole CPU; 5% of one must throttle it
	// within a few 100 ms periods.
	if !wait.Until(5*time.Second, func() bool {
		n, err := l.Throttled()
		if err != nil {
			t.Fatal(err)
		}
		return n > 0
	}) {
		t.Fatal("a busy process under a 0.05 CPU quota was never throttled")
	}
}

func TestLimitCPURefusesTinyQuota(t *testing.T) {
	if _, err := Apply(1, 0.001); err == nil {
		t.Fatal("a 0.001 CPU quota was accepted")
	}
}
