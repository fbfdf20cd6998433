package mcreport

import (
	"context"
	"reflect"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
)

// SignalSource reads the pod's own state; the scheduler's Stats is one
// (see worker/cmd/worker). It must be cheap and safe to call from any
// goroutine.
type SignalSource interface {
	PodSignals() api.PodSignals
}

// SignalSourceFunc adapts a function to SignalSource.
type SignalSourceFunc func() api.PodSignals

func (f SignalSourceFunc) PodSignals() api.PodSignals { return f() }

// Push cadence: the source is read every SignalPoll and sent when it
// changed, and at least every SignalEvery (the metadata center answers
// reports up to its --signal-max-age, 1 s by default, so a pod that is
// steady stays visible).
const (
	SignalPoll  = 10 * time.Millisecond
	SignalEvery = 100 * time.Millisecond
	// DefaultRegisterEvery refreshes a registration six times within the
	// metadata center's default TTL (api.DefaultRegistrationTTLMS): the
	// static part rides on one report in 50, not on every one, and a
	// metadata center that lost it (restart of the embedded store) has it
	// back within this period.
	DefaultRegisterEvery = 5 * time.Second
)

// RunSignals pushes the pod's signals until ctx ends: on change (checked
// every poll, and at once on Nudge; sameState) and at least every `every`; with Config.Registration, the
// first report and one every RegisterEvery also register the pod (a
// registration that did not land goes with the next report). poll and every <= 0 take
// SignalPoll and SignalEvery. Failures are counted and logged at most once
// per 10 s: a report that did not land is replaced by the next one anyway.
func (r *Reporter) RunSignals(ctx context.Context, src SignalSource, poll, every time.Duration) {
	if poll <= 0 {
		poll = SignalPoll
	}
	if every <= 0 {
		every = SignalEvery
	}
	tick := time.NewTicker(poll)
	defer tick.Stop()
	regEvery := r.cfg.RegisterEvery
	if regEvery <= 0 {
		regEvery = DefaultRegisterEvery
	}
	var last api.PodSignals
	var lastSent, lastWarn, lastReg time.Time
	for {
		cur := src.PodSignals()
		now := time.Now()
		var reg *api.PodRegistration
		if r.cfg.Registration != nil && (lastReg.IsZero() || now.Sub(lastReg) >= regEvery) {
			reg = r.cfg.Registration
		}
		if !sameState(cur, last) || now.Sub(lastSent) >= every || reg != nil {
			err := r.mc.ReportSignals(ctx, cur.Report(r.cfg.Cluster, r.cfg.Host, reg))
			switch {
			case err == nil:
				r.signals.WithLabelValues("ok").Inc()
				last, lastSent = cur, now
				if reg != nil {
					if lastReg.IsZero() {
						r.log.Info("metadata center: registered this pod", "host", r.cfg.Host, "cluster", r.cfg.Cluster,
							"labels", reg.Labels, "adapters", reg.Adapters, "models", reg.Models)
					}
					lastReg = now
				}
			case ctx.Err() != nil:
				return
			default:
				if client.Permanent(err) {
					r.signals.WithLabelValues("rejected").Inc()
				} else {
					r.signals.WithLabelValues("error").Inc()
				}
				if now.Sub(lastWarn) >= 10*time.Second {
					r.log.Warn("metadata center: pod signal report failed", "err", err)
					lastWarn = now
				}
				// Sent again at the next poll: last is unchanged.
				lastSent = now
			}
		}
		select {
		case <-tick.C:
		case <-r.nudge:
		case <-ctx.Done():
			return
		}
	}
}

// sameState says whether two reports tell the same: the step in
// progress and a hold run down between any two reads, and count as a
// change only with something else (a new step changes the prefills left).
func sameState(a, b api.PodSignals) bool {
	a.StepLeftSeconds, b.StepLeftSeconds = 0, 0
	a.HoldLeftSeconds, b.HoldLeftSeconds = 0, 0
	return reflect.DeepEqual(a, b)
}

// Nudge makes RunSignals read the source and send what changed now rather
// than at its next poll: the start of a drain reaches the gateways at once.
// It never blocks.
func (r *Reporter) Nudge() {
	select {
	case r.nudge <- struct{}{}:
	default:
	}
}

func newSignalCounter() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "llmf_worker_signal_reports_total",
		Help: "POST /v1/pods/signals calls by result (ok, error, rejected)."}, []string{"result"})
}
