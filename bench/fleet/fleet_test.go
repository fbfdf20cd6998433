package fleet

import (
	"os/exec"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

// A gateway that lost its port exits at once; Start tells that from one
// still running by its process state, a killed child being a zombie until
// it is reaped.
func TestExitedTellsARunningProcessFromADeadOne(t *testing.T) {
	p := exec.Command("sleep", "30")
	if err := p.Start(); err != nil {
		t.Skipf("no sleep command: %v", err)
	}
	defer func() { _ = p.Process.Kill(); _ = p.Wait() }()
	if exited(p) {
		t.Fatal("a running sleep reads as exited")
	}
	if err := p.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	if !wait.Until(5*time.Second, func() bool { return exited(p) }) {
		t.Fatal("a killed, unreaped child does not read as exited")
	}
}
