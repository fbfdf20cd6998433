package server

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/worker/openai"
)

// drain is the server's shutdown gate (docs/worker.md, "Shutdown"): once
// Drain is called, /readyz answers 503 and new generation requests get 503
// with Retry-After, while the ones already accepted run to their end.
// Idle tells when none is left.
type drain struct {
	mu       sync.Mutex
	draining bool
	inFlight int
	idle     chan struct{} // closed when draining and inFlight is 0
}

// begin admits a generation request unless the server drains.
func (d *drain) begin() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.draining {
		return false
	}
	d.inFlight++
	return true
}

func (d *drain) end() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.inFlight--
	if d.draining && d.inFlight == 0 {
		close(d.idle)
	}
}

// start turns draining on once.
func (d *drain) start() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.draining {
		return
	}
	d.draining = true
	d.idle = make(chan struct{})
	if d.inFlight == 0 {
		close(d.idle)
	}
}

func (d *drain) on() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.draining
}

// Drain stops taking generation requests (503 with Retry-After, readiness
// false); the ones accepted before go on.
func (s *Server) Drain() { s.drain.start() }

// Draining says whether Drain was called: the pod reports it to the
// metadata center, so that gateways stop routing to it.
func (s *Server) Draining() bool { return s.drain.on() }

// Drained waits until every generation request accepted before Drain has
// ended, or ctx ends (its error then).
func (s *Server) Drained(ctx context.Context) error {
	s.drain.mu.Lock()
	idle := s.drain.idle
	s.drain.mu.Unlock()
	if idle == nil {
		return nil // not draining: nothing to wait for
	}
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// InFlight counts the generation requests being served.
func (s *Server) InFlight() int {
	s.drain.mu.Lock()
	defer s.drain.mu.Unlock()
	return s.drain.inFlight
}

// generation tells the requests the drain gate counts: the API's POSTs.
func generation(r *http.Request) bool {
	return r.Method == http.MethodPost && strings.HasPrefix(r.URL.Path, "/v1/")
}

func draining() *openai.Error {
	return &openai.Error{Status: http.StatusServiceUnavailable, Type: openai.TypeUnavailable,
		Message: "the worker is draining before it shuts down; retry on another replica", RetryAfter: time.Second}
}
