package lifecycle

import (
	"context"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

// eventually waits up to 5 s for cond.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	wait.For(t, 5*time.Second, what, cond)
}

// gateway is what a host builds: a decider and the reporter of its
// decisions, sharing one count of requests in flight.
type gateway struct {
	*routing.Decider
	*Reporter
}

// Decide decides and starts the decision's lifecycle record.
func (g gateway) Decide(ctx context.Context, h routing.Headers, body []byte) (*Request, error) {
	d, err := g.Decider.Decide(ctx, h, body)
	if err != nil {
		return nil, err
	}
	return NewRequest(d), nil
}

// newGateway builds a gateway over the static pods (unless o says
// otherwise); u, if not nil, replaces the metadata-center client's updates.
func newGateway(t testing.TB, cfg *config.Config, o routing.Options, u Updater) gateway {
	t.Helper()
	if o.Endpoints == nil {
		o.Endpoints = staticSource(t)
	}
	if o.Logger == nil {
		o.Logger = quiet()
	}
	d, err := routing.New(cfg, o)
	if err != nil {
		t.Fatal(err)
	}
	r, err := New(cfg, Options{Tracker: d.Tracker(), Checker: d.Balancer(), Updater: u, Metrics: o.Metrics, Logger: o.Logger})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	return gateway{d, r}
}
