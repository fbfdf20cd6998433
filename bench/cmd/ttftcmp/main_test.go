package main

import (
	"os"
	"os/exec"
	"syscall"
	"testing"
	"time"
)

func selfCPU() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// spin burns d of this process's CPU time (not wall time: the machine may
// be loaded).
func spin(d time.Duration) {
	for end := selfCPU() + d; selfCPU() < end; {
	}
}

// TestSpinHelper is the child of the test below.
func TestSpinHelper(t *testing.T) {
	if os.Getenv("TTFTCMP_SPIN") == "" {
		t.Skip("helper")
	}
	spin(400 * time.Millisecond)
	time.Sleep(time.Minute)
}

// treeCPU counts this process's own work and that of a child it started.
func TestTreeCPUCountsTheProcessAndItsChildren(t *testing.T) {
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("no /proc")
	}
	t0, r0 := treeCPU(os.Getpid()), selfCPU()
	spin(300 * time.Millisecond)
	own := treeCPU(os.Getpid()) - t0
	if want := selfCPU() - r0; own < want-50*time.Millisecond || own > want+50*time.Millisecond {
		t.Fatalf("treeCPU counted %v of this process's %v", own, want)
	}
	cmd := exec.Command(os.Args[0], "-test.run=TestSpinHelper")
	cmd.Env = append(os.Environ(), "TTFTCMP_SPIN=1")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	t1, r1 := treeCPU(os.Getpid()), selfCPU()
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		child := treeCPU(os.Getpid()) - t1 - (selfCPU() - r1)
		if child >= 350*time.Millisecond {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("a child's 400 ms of work counted as %v", child)
		}
	}
	if treeCPU(0) != 0 {
		t.Fatal("pid 0 has CPU time")
	}
}
