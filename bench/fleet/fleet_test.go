package fleet

import (
	"os/exec"
	"testing"
	"time"
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
	deadline := time.Now().Add(5 * time.Second)
	for !exited(p) {
		if time.Now().After(deadline) {
			t.Fatal("a killed, unreaped child does not read as exited")
		}
		time.Sleep(10 * time.Millisecond)
	}
}
