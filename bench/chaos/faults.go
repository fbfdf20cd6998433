package chaos

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/fleet"
)

// rollingDrain bounds one worker's drain in the rolling restart: above the
// workers' request timeout (30 s), as --drain-timeout is in deploy/.
const rollingDrain = 45 * time.Second

// workerKinds says what the fleet's workers are: "3 simulated + the
// llama.cpp one".
func workerKinds(cfg Config) string {
	if cfg.Llama {
		return fmt.Sprintf("%d simulated + the llama.cpp one", cfg.SimWorkers)
	}
	return fmt.Sprintf("%d simulated", cfg.SimWorkers)
}

// inFlightAt reports whether r was outstanding at t.
func inFlightAt(r Record, t time.Duration) bool { return r.Start <= t && t <= r.End }

// buildFaults turns names into the schedule's faults on fleet f.
func buildFaults(names []string, f *fleet.Fleet, load *Load, cfg Config, start time.Time) ([]Fault, error) {
	var out []Fault
	llama := len(f.Workers) - 1 // the llama worker is the extra one, last
	for _, name := range names {
		var ft Fault
		switch name {
		case "worker-kill":
			const victim = 0
			addr := f.Workers[victim]
			var mu sync.Mutex
			var at, back time.Duration // the kill, and the restart once done
			ids := map[int]bool{}
			ft = Fault{Name: name, Hold: 3 * time.Second,
				What: fmt.Sprintf("kill -9 worker %s with a stream in flight, restart it on the same address 3 s later", addr),
				Inject: func(ctx context.Context) error {
					// Wait (up to 10 s) for a stream that has its first token.
					deadline := time.Now().Add(10 * time.Second)
					for load.StreamingOn(addr) == 0 && time.Now().Before(deadline) && ctx.Err() == nil {
						time.Sleep(10 * time.Millisecond)
					}
					mu.Lock()
					for _, id := range load.InFlightOn(addr) {
						ids[id] = true
					}
					at = time.Since(start)
					mu.Unlock()
					f.KillWorker(victim)
					return nil
				},
				Recover: func(ctx context.Context) error {
					err := f.RestartWorker(ctx, victim)
					mu.Lock()
					back = time.Since(start)
					mu.Unlock()
					return err
				},
				Expected: func(r Record) bool {
					mu.Lock()
					defer mu.Unlock()
					// Streams known to be on it, and unstreamed requests in
					// flight at the kill whose pod is unknown or it. And a
					// request sent to it while it was dead whose reused
					// connection reset before any answer (503): the pod may
					// have had it, so neither Envoy's connect-failure retry
					// (Istio's default policy) nor the gateway's retries it.
					return ids[r.ID] || (inFlightAt(r, at) && (r.Worker == addr || r.Worker == "")) ||
						(r.Worker == addr && r.Status == 503 && r.Start >= at && (back == 0 || r.Start < back))
				},
			}
		case "rolling-restart":
			// Every worker in turn, the llama.cpp one included, as a
			// Deployment rollout replaces pods one at a time
			// (deploy/base/worker.yaml: maxUnavailable 0): SIGTERM (the
			// worker drains: what it accepted finishes, new requests get
			// 503 + Retry-After, and it reports that it drains), start it
			// again on its address once it exited, wait until it is ready
			// (/readyz, what the rollout waits for), next. The aim: no
			// stream cut, no request lost. Every worker serves the same
			// model, so while one drains the gateways route around it; a
			// request that reached it before they knew gets 503 with
			// Retry-After, which the client retries as the OpenAI SDKs do;
			// one routed to it while it is down is refused at connect, and
			// the gateway retries it on another pod (connect_retries).
			n := len(f.Workers)
			engine := func(i int) string {
				if i < cfg.SimWorkers {
					return "sim"
				}
				return "llama"
			}
			var mu sync.Mutex
			var done []Restart
			ft = Fault{Name: name,
				What: fmt.Sprintf("restart all %d workers (%s) one by one as a rollout does: SIGTERM with a stream in flight (drain, up to %v), start again on the same address once it exited, wait for its readiness before the next",
					n, workerKinds(cfg), rollingDrain),
				Inject: func(ctx context.Context) error {
					var errs []error
					for i := range n {
						if ctx.Err() != nil {
							break
						}
						addr := f.Workers[i]
						// As worker-kill does: wait (up to 10 s) for a
						// stream that has its first token, so the drain
						// has one to let finish.
						deadline := time.Now().Add(10 * time.Second)
						for load.StreamingOn(addr) == 0 && time.Now().Before(deadline) && ctx.Err() == nil {
							time.Sleep(10 * time.Millisecond)
						}
						rs := Restart{Worker: addr, Engine: engine(i), OldPID: f.WorkerPID(i),
							Streaming: load.StreamingOn(addr), InFlight: load.InFlightOn(addr)}
						t0 := time.Now()
						err := f.DrainWorker(i, rollingDrain)
						rs.DrainS = time.Since(t0).Seconds()
						t1 := time.Now()
						// Started again even when the drain failed: the
						// rollout goes on, and the report says what failed.
						bg := context.WithoutCancel(ctx)
						if rerr := f.RestartWorker(bg, i); rerr != nil {
							err = errors.Join(err, rerr)
						} else if rerr := f.WaitWorkerReady(bg, i); rerr != nil {
							err = errors.Join(err, rerr)
						}
						rs.ReadyS = time.Since(t1).Seconds()
						if pid := f.WorkerPID(i); pid != rs.OldPID {
							rs.NewPID = pid
						}
						if err != nil {
							rs.Err = err.Error()
							errs = append(errs, err)
						}
						mu.Lock()
						done = append(done, rs)
						mu.Unlock()
					}
					return errors.Join(errs...)
				},
				Restarts: func() []Restart {
					mu.Lock()
					defer mu.Unlock()
					return slices.Clone(done)
				},
			}
		case "redis-restart":
			ft = Fault{Name: name, Hold: 3 * time.Second,
				What:    "stop redis-server (no persistence: it comes back empty), start it again 3 s later",
				Inject:  func(context.Context) error { return f.StopRedis() },
				Recover: func(ctx context.Context) error { return f.StartRedis(ctx) },
			}
		case "redis-pause":
			ft = Fault{Name: name, Hold: 2 * time.Second,
				What:    "SIGSTOP redis-server for 2 s, then SIGCONT",
				Inject:  func(context.Context) error { return f.PauseRedis() },
				Recover: func(context.Context) error { return f.ResumeRedis() },
			}
		case "mc-restart":
			ft = Fault{Name: name, Hold: 2 * time.Second,
				What:    "stop the metadata center (SIGTERM), start it again on its address 2 s later",
				Inject:  func(context.Context) error { f.StopMC(); return nil },
				Recover: func(ctx context.Context) error { return f.StartMC(ctx) },
			}
		case "gateway-kill":
			const victim = 1
			var mu sync.Mutex
			var at time.Duration
			gw := f.Gateways[victim]
			ft = Fault{Name: name, Hold: 3 * time.Second,
				What: "kill -9 the second gateway, restart it on the same address 3 s later",
				Inject: func(context.Context) error {
					mu.Lock()
					at = time.Since(start)
					mu.Unlock()
					f.KillGateway(victim)
					return nil
				},
				Recover: func(ctx context.Context) error { return f.RestartGateway(ctx, victim) },
				Expected: func(r Record) bool {
					mu.Lock()
					defer mu.Unlock()
					return r.Gateway == gw && inFlightAt(r, at)
				},
			}
		case "slow-worker":
			if !cfg.Llama || cfg.LlamaCPUs <= 0 {
				return nil, fmt.Errorf("fault %s needs the llama worker with a CPU quota", name)
			}
			ft = Fault{Name: name, Hold: 10 * time.Second,
				What:    fmt.Sprintf("the llama worker's CPU quota from %.2g to %.2g CPU (10× slower steps) for 10 s", cfg.LlamaCPUs, cfg.LlamaCPUs/10),
				Inject:  func(context.Context) error { return f.SetWorkerCPUs(llama, cfg.LlamaCPUs/10) },
				Recover: func(context.Context) error { return f.SetWorkerCPUs(llama, cfg.LlamaCPUs) },
			}
		case "client-disconnect":
			ft = Fault{Name: name,
				What:   "10 s of 4 extra clients that each stream a request and go away after its first token",
				Inject: func(ctx context.Context) error { load.Disconnects(ctx, 10*time.Second, 4, cfg.Seed+7); return nil },
			}
		case "burst":
			var mu sync.Mutex
			var from, to time.Duration
			ft = Fault{Name: name,
				What: fmt.Sprintf("%d requests at once over both gateways, more than the workers' queues (%d) and running sets (%d) hold",
					cfg.Burst, cfg.WorkerQueue, cfg.WorkerRunning),
				Inject: func(ctx context.Context) error {
					mu.Lock()
					from = time.Since(start)
					mu.Unlock()
					load.Burst(ctx, cfg.Burst, cfg.Seed+11)
					mu.Lock()
					to = time.Since(start)
					mu.Unlock()
					return nil
				},
				// A 429 that outlived the client's retries is load shed by
				// the burst: a burst request's, or any request's whose
				// last refusal came while the burst's requests were still
				// in flight (the queues it found full were the burst's; a
				// worker cannot tell the two kinds apart).
				Expected: func(r Record) bool {
					mu.Lock()
					defer mu.Unlock()
					return r.Status == http.StatusTooManyRequests && (r.Kind == "burst" || from <= r.End && r.End <= to)
				},
			}
		default:
			return nil, fmt.Errorf("unknown fault %q (known: %v)", name, FaultNames)
		}
		out = append(out, ft)
	}
	return out, nil
}
