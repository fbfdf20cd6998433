package fleet

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/cpulimit"
)

// What the chaos run (bench/chaos) does to a running fleet: kill parts
// outright, start them again on the same address with the same flags,
// freeze and thaw them, and change a worker's CPU quota.

// spawnWorker starts worker i with its recorded flags (so on its address).
func (f *Fleet) spawnWorker(i int) error {
	p, err := f.spawn(f.spec, "worker", fmt.Sprintf("worker-%d", i), f.workerArgs[i]...)
	if err != nil {
		return err
	}
	f.workers[i] = p
	if c := f.workerCPUs[i]; c > 0 {
		l, err := cpulimit.Apply(p.Process.Pid, c)
		if err != nil {
			return err
		}
		f.workerLim[i] = l
		f.limits = append(f.limits, l)
	}
	return nil
}

// RestartWorker starts worker i again on its address after KillWorker, as
// a crashed pod's replacement keeps its IP.
func (f *Fleet) RestartWorker(ctx context.Context, i int) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if l := f.workerLim[i]; l != nil {
		l.Remove() // empty now: its process is gone
		f.workerLim[i] = nil
	}
	if err := f.spawnWorker(i); err != nil {
		return err
	}
	return waitHealthy(ctx, "http://"+f.Workers[i]+"/healthz")
}

// WaitWorkerReady waits until worker i's /readyz answers 200, as a
// rollout waits for the new pod's readiness before it replaces the next.
func (f *Fleet) WaitWorkerReady(ctx context.Context, i int) error {
	return waitHealthy(ctx, "http://"+f.Workers[i]+"/readyz")
}

// WorkerPID is worker i's process id, 0 when it is not running.
func (f *Fleet) WorkerPID(i int) int {
	if p := f.workers[i]; p != nil && p.Process != nil {
		return p.Process.Pid
	}
	return 0
}

// DrainWorker stops worker i the way the kubelet stops a pod: SIGTERM,
// then its drain (running and queued requests finish, new ones get 503)
// for at most within, then SIGKILL. It reports how the process ended: an
// error unless it exited 0 by itself.
func (f *Fleet) DrainWorker(i int, within time.Duration) error {
	p := f.workers[i]
	if p == nil {
		return fmt.Errorf("worker %d is not running", i)
	}
	defer f.forget(p)
	_ = p.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- p.Wait() }()
	select {
	case err := <-done:
		if err != nil {
			return fmt.Errorf("worker %d drained and exited: %w", i, err)
		}
		return nil
	case <-time.After(within):
		_ = p.Process.Kill()
		<-done
		return fmt.Errorf("worker %d still draining after %v: killed", i, within)
	}
}

// SetWorkerCPUs changes worker i's CPU quota (a slow pod), giving it one
// if it had none.
func (f *Fleet) SetWorkerCPUs(i int, cpus float64) error {
	if l := f.workerLim[i]; l != nil {
		return l.Set(cpus)
	}
	l, err := cpulimit.Apply(f.workers[i].Process.Pid, cpus)
	if err != nil {
		return err
	}
	f.workerLim[i] = l
	f.limits = append(f.limits, l)
	return nil
}

// KillGateway kills gateway i outright (SIGKILL).
func (f *Fleet) KillGateway(i int) {
	f.kill(f.gateways[i])
}

// RestartGateway starts gateway i again on its address with its config.
func (f *Fleet) RestartGateway(ctx context.Context, i int) error {
	name := "gateway"
	if i > 0 {
		name = fmt.Sprintf("gateway-%d", i)
	}
	p, err := f.spawn(f.spec, "gateway", name, f.gwArgs[i]...)
	if err != nil {
		return err
	}
	f.gateways[i] = p
	return waitHealthy(ctx, f.Gateways[i]+"/healthz")
}

// KillMC kills the (first) metadata center outright; StartMC restarts it.
func (f *Fleet) KillMC() { f.kill(f.mc) }

// StopRedis stops the fleet's redis-server (SIGTERM, no persistence: it
// comes back empty, as a Redis without a volume would).
func (f *Fleet) StopRedis() error {
	if f.redis == nil {
		return errors.New("fleet: no redis-server of its own")
	}
	f.terminate(f.redis)
	f.redis = nil
	return nil
}

// StartRedis starts the fleet's redis-server again on its port.
func (f *Fleet) StartRedis(ctx context.Context) error {
	if f.redisArgs == nil {
		return errors.New("fleet: no redis-server of its own")
	}
	p, err := f.spawnPath(f.spec, "redis-server", "redis-0", f.redisArgs...)
	if err != nil {
		return err
	}
	f.redis = p
	return waitRedis(ctx, f.RedisAddr, "PONG", "ping")
}

// PauseRedis freezes the redis-server (SIGSTOP): connections stay open and
// calls hang, as on a stalled node; ResumeRedis thaws it (SIGCONT).
func (f *Fleet) PauseRedis() error  { return f.signalRedis(syscall.SIGSTOP) }
func (f *Fleet) ResumeRedis() error { return f.signalRedis(syscall.SIGCONT) }

func (f *Fleet) signalRedis(sig syscall.Signal) error {
	if f.redis == nil {
		return errors.New("fleet: no redis-server running")
	}
	return f.redis.Process.Signal(sig)
}

func (f *Fleet) kill(p *exec.Cmd) {
	if p == nil {
		return
	}
	_ = p.Process.Kill()
	_ = p.Wait()
	f.forget(p)
}

// Proc is one running process of the fleet.
type Proc struct {
	Name string // as its log file is called: worker-0, gateway-1, redis-0, …
	PID  int
}

// Procs lists the fleet's running processes.
func (f *Fleet) Procs() []Proc {
	out := make([]Proc, 0, len(f.procs))
	for _, p := range f.procs {
		out = append(out, Proc{Name: f.names[p], PID: p.Process.Pid})
	}
	return out
}

// LogPath is where process name writes its output.
func (f *Fleet) LogPath(name string) string { return filepath.Join(f.LogDir, name+".log") }
