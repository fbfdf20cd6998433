package fleet

import (
	"bufio"
	"os"
	"os/exec"
	"strconv"
	"syscall"
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

const prSetChildSubreaper = 36 // linux/prctl.h

// A bench killed outright (or by a write to a closed pipe) cannot stop its
// fleet; the kernel then sends every process it started SIGTERM. The bench
// here is this test binary run again: it starts a child as the fleet does,
// prints the child's pid and waits to be killed.
func TestAFleetDiesWithItsBench(t *testing.T) {
	if os.Getenv("FLEET_TEST_BENCH") == "1" {
		f := &Fleet{}
		cmd, err := f.spawnPath(Spec{LogDir: os.Getenv("FLEET_TEST_LOGS")}, "sleep", "sleep", "300")
		if err != nil {
			os.Exit(2)
		}
		os.Stdout.WriteString(strconv.Itoa(cmd.Process.Pid) + "\n")
		select {}
	}
	if _, err := exec.LookPath("sleep"); err != nil {
		t.Skipf("no sleep command: %v", err)
	}
	// The orphaned child is reparented to this process, which can then
	// reap it and read how it ended.
	if _, _, e := syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 1, 0); e != 0 {
		t.Skipf("prctl(PR_SET_CHILD_SUBREAPER): %v", e)
	}
	defer syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 0, 0)

	bench := exec.Command(os.Args[0], "-test.run=^TestAFleetDiesWithItsBench$")
	bench.Env = append(os.Environ(), "FLEET_TEST_BENCH=1", "FLEET_TEST_LOGS="+t.TempDir())
	out, err := bench.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := bench.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		_ = bench.Process.Kill()
		t.Fatalf("the bench printed no child: %v", err)
	}
	child, err := strconv.Atoi(line[:len(line)-1])
	if err != nil {
		t.Fatal(err)
	}
	if err := bench.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = bench.Wait()

	ended := make(chan syscall.WaitStatus, 1)
	go func() {
		var ws syscall.WaitStatus
		if _, err := syscall.Wait4(child, &ws, 0, nil); err == nil {
			ended <- ws
		}
	}()
	select {
	case ws := <-ended:
		if !ws.Signaled() || ws.Signal() != syscall.SIGTERM {
			t.Fatalf("the child ended with %v, want SIGTERM", ws)
		}
	case <-time.After(10 * time.Second):
		_ = syscall.Kill(child, syscall.SIGKILL)
		t.Fatal("the child outlived its bench by 10 s")
	}
}
