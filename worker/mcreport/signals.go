package mcreport

import (
	"context"
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
)

// RunSignals pushes the pod's signals until ctx ends: on change (checked
// every poll) and at least every `every`. poll and every <= 0 take
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
	var last api.PodSignals
	var lastSent, lastWarn time.Time
	for {
		cur := src.PodSignals()
		if now := time.Now(); cur != last || now.Sub(lastSent) >= every {
			err := r.mc.ReportSignals(ctx, api.PodReport{
				Cluster: r.cfg.Cluster, Host: r.cfg.Host,
				Waiting: cur.Waiting, Running: cur.Running, KVCacheUtil: cur.KVCacheUtil, PrefillTokens: cur.PrefillTokens,
			})
			switch {
			case err == nil:
				r.signals.WithLabelValues("ok").Inc()
				last, lastSent = cur, now
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
		case <-ctx.Done():
			return
		}
	}
}

func newSignalCounter() *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: "llmf_worker_signal_reports_total",
		Help: "POST /v1/pods/signals calls by result (ok, error, rejected)."}, []string{"result"})
}
