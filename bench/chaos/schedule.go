package chaos

import (
	"context"
	"fmt"
	"time"
)

// Fault is one entry of the schedule: Inject breaks something, Recover
// mends it after Hold. Either may be nil (a fault that ends by itself).
type Fault struct {
	Name    string
	What    string // one line for the report
	Hold    time.Duration
	Inject  func(ctx context.Context) error
	Recover func(ctx context.Context) error
	// Expected, if set, tells the report which failures the fault itself
	// made unanswerable (e.g. requests in flight on a killed worker).
	Expected func(r Record) bool
	// Restarts, if set, lists after the recovery the workers the fault
	// restarted (the rolling restart).
	Restarts func() []Restart
}

// Restart is one worker replaced by the rolling restart.
type Restart struct {
	Worker string `json:"worker"` // its address, the same before and after
	Engine string `json:"engine"` // sim | llama
	OldPID int    `json:"old_pid"`
	NewPID int    `json:"new_pid"` // 0: not started again
	// InFlight are the ids of the requests it was serving at the
	// SIGTERM, Streaming how many of them were streams with a token out.
	InFlight  []int   `json:"in_flight,omitempty"`
	Streaming int     `json:"streaming"`
	DrainS    float64 `json:"drain_s"` // SIGTERM → the process exited
	ReadyS    float64 `json:"ready_s"` // exited → the new one's /readyz answered 200
	Err       string  `json:"error,omitempty"`
}

// Window is what happened to one fault, in run time.
type Window struct {
	Name  string        `json:"name"`
	What  string        `json:"what"`
	Start time.Duration `json:"start_ns"` // Inject called
	End   time.Duration `json:"end_ns"`   // Recover returned: the fault is over
	Next  time.Duration `json:"next_ns"`  // start of the next window (or the run's end)
	Err   string        `json:"error,omitempty"`
	// Restarts are the workers the fault restarted, in order.
	Restarts []Restart `json:"restarts,omitempty"`

	expected func(Record) bool
}

// Observer is called at fixed points of the schedule: after each fault's
// recovery plus Settle (the index check), and at the end of each window.
type Observer interface {
	Recovered(ctx context.Context, w *Window)
	WindowDone(ctx context.Context, w *Window)
}

// Schedule runs faults one after the other: Baseline of plain load first,
// then for each fault inject, hold, recover, wait Settle, observe, and
// let the system run for Gap before the next fault.
type Schedule struct {
	Baseline time.Duration
	Settle   time.Duration // recovery → index check (the issue says 1 s)
	Gap      time.Duration // recovery → next fault
	Faults   []Fault
	Log      func(format string, args ...any)
	// Before, if set, runs after the baseline, before the first fault.
	Before func(ctx context.Context)
}

// Run executes the schedule; runStart is the run's time origin. A fault
// whose Inject or Recover fails is recorded and the run goes on (and its
// recovery is attempted regardless).
func (s Schedule) Run(ctx context.Context, runStart time.Time, obs Observer) []Window {
	logf := s.Log
	if logf == nil {
		logf = func(string, ...any) {}
	}
	since := func() time.Duration { return time.Since(runStart) }
	sleep(ctx, s.Baseline)
	if s.Before != nil && ctx.Err() == nil {
		s.Before(ctx)
	}
	var out []Window
	for i, f := range s.Faults {
		if ctx.Err() != nil {
			break
		}
		w := Window{Name: f.Name, What: f.What, Start: since(), expected: f.Expected}
		logf("[%d/%d] %s: %s", i+1, len(s.Faults), f.Name, f.What)
		var errs []string
		if f.Inject != nil {
			if err := f.Inject(ctx); err != nil {
				errs = append(errs, "inject: "+err.Error())
			}
		}
		sleep(ctx, f.Hold)
		if f.Recover != nil {
			// Recovery must happen even when the run is being stopped.
			if err := f.Recover(context.WithoutCancel(ctx)); err != nil {
				errs = append(errs, "recover: "+err.Error())
			}
		}
		w.End = since()
		if f.Restarts != nil {
			w.Restarts = f.Restarts()
		}
		if len(errs) > 0 {
			w.Err = fmt.Sprint(errs)
			logf("  %s: %s", f.Name, w.Err)
		}
		sleep(ctx, s.Settle)
		if obs != nil {
			obs.Recovered(ctx, &w)
		}
		sleep(ctx, s.Gap-s.Settle)
		w.Next = since()
		if obs != nil {
			obs.WindowDone(ctx, &w)
		}
		out = append(out, w)
	}
	return out
}

func sleep(ctx context.Context, d time.Duration) {
	if d <= 0 {
		return
	}
	select {
	case <-time.After(d):
	case <-ctx.Done():
	}
}
