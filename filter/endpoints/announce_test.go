package endpoints

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"reflect"
	"sync"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

type announcements struct {
	mu   sync.Mutex
	got  []string // "cluster backend hosts"
	fail bool
}

func (a *announcements) announce(_ context.Context, cluster, backend string, hosts []string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.fail {
		return errors.New("metadata center down")
	}
	a.got = append(a.got, cluster+" "+backend+" "+joinHosts(hosts))
	return nil
}

func joinHosts(hs []string) string {
	out := ""
	for i, h := range hs {
		if i > 0 {
			out += ","
		}
		out += h
	}
	return out
}

func (a *announcements) list() []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]string(nil), a.got...)
}

// The announcer announces each cluster's endpoints, sorted and once each,
// at once when they change and again at its refresh interval; clusters
// without endpoints are skipped, and a failed announcement is retried.
func TestAnnouncerFollowsTheSource(t *testing.T) {
	src, err := NewStatic(map[string][]string{"a": {"10.0.0.2:8000", "10.0.0.1:8000"}})
	if err != nil {
		t.Fatal(err)
	}
	layered := &swappable{src: src}
	a := &announcements{}
	stop := StartAnnouncer(AnnouncerOptions{Source: layered, Clusters: map[string]string{"a": "vllm", "empty": "sglang"},
		Announce: a.announce, Check: 5 * time.Millisecond, Refresh: time.Hour, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	defer stop()
	wait.For(t, 5*time.Second, "the first announcement", func() bool { return len(a.list()) == 1 })
	if got := a.list(); !reflect.DeepEqual(got, []string{"a vllm 10.0.0.1:8000,10.0.0.2:8000"}) {
		t.Fatalf("announced %v", got)
	}
	grown, err := NewStatic(map[string][]string{"a": {"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}})
	if err != nil {
		t.Fatal(err)
	}
	layered.set(grown)
	wait.For(t, 5*time.Second, "the change announced", func() bool { return len(a.list()) == 2 })
	if got := a.list()[1]; got != "a vllm 10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000" {
		t.Fatalf("announced %q", got)
	}
	stop()

	// Refreshed at the interval; retried after a failure.
	b := &announcements{fail: true}
	stop = StartAnnouncer(AnnouncerOptions{Source: src, Clusters: map[string]string{"a": "vllm"},
		Announce: b.announce, Check: 5 * time.Millisecond, Refresh: 20 * time.Millisecond, Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	defer stop()
	b.mu.Lock()
	b.fail = false
	b.mu.Unlock()
	wait.For(t, 5*time.Second, "three refreshes", func() bool { return len(b.list()) >= 3 })
}

// swappable is a Source whose answer the test replaces.
type swappable struct {
	mu  sync.Mutex
	src Source
}

func (s *swappable) set(src Source) { s.mu.Lock(); s.src = src; s.mu.Unlock() }

func (s *swappable) Endpoints(cluster string) []Endpoint {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.src.Endpoints(cluster)
}
