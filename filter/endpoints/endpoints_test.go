package endpoints

import (
	"context"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

// adminJSON is shaped like Envoy 1.36's GET /clusters?format=json (trimmed
// stats, same structure): snake_case names, uint ports, stats with string
// values, health_status with the eds_health_status enum as a string.
const adminJSON = `{
 "cluster_statuses": [
  {
   "name": "outbound|8000||qwen.llm.svc.cluster.local",
   "added_via_api": true,
   "host_statuses": [
    {
     "address": {"socket_address": {"address": "10.0.1.1", "port_value": 8000}},
     "stats": [{"name": "cx_connect_fail"}, {"value": "12", "name": "cx_total"}, {"type": "GAUGE", "name": "cx_active"}],
     "health_status": {"eds_health_status": "HEALTHY"},
     "weight": 1,
     "locality": {"region": "r1", "zone": "z1"}
    },
    {
     "address": {"socket_address": {"address": "10.0.1.2", "port_value": 8000}},
     "health_status": {"eds_health_status": "HEALTHY", "failed_outlier_check": true},
     "weight": 1
    },
    {
     "address": {"socket_address": {"address": "10.0.1.3", "port_value": 8000}},
     "health_status": {"eds_health_status": "UNHEALTHY"},
     "weight": 1
    },
    {
     "address": {"socket_address": {"address": "10.0.1.4", "port_value": 8000}},
     "health_status": {"failed_active_health_check": true},
     "weight": 1
    },
    {
     "address": {"socket_address": {"address": "10.0.1.5", "port_value": 8000}},
     "health_status": {"eds_health_status": "DRAINING"},
     "weight": 1
    },
    {
     "address": {"socket_address": {"address": "10.0.1.6", "port_value": 8000}},
     "health_status": {"eds_health_status": "DEGRADED"},
     "weight": 1
    },
    {
     "address": {"socket_address": {"address": "10.0.1.7", "port_value": 8000}},
     "health_status": {"pending_dynamic_removal": true, "eds_health_status": "HEALTHY"},
     "weight": 1
    },
    {
     "address": {"socket_address": {"address": "fd00::8", "port_value": 8000}},
     "health_status": {"eds_health_status": "HEALTHY"},
     "weight": 1
    },
    {
     "address": {"pipe": {"path": "/var/run/sock"}},
     "health_status": {"eds_health_status": "HEALTHY"}
    },
    {
     "address": {"socket_address": {"address": "10.0.1.1", "port_value": 8000}},
     "health_status": {"eds_health_status": "HEALTHY"}
    }
   ]
  },
  {
   "name": "BlackHoleCluster",
   "circuit_breakers": {"thresholds": [{"max_connections": 1024}]}
  },
  {
   "name": "outbound|8000||static.llm.svc.cluster.local",
   "host_statuses": [
    {"address": {"socket_address": {"address": "10.0.2.1", "port_value": 9000}}, "health_status": {}}
   ]
  }
 ]
}`

func addrs(eps []Endpoint) []string {
	out := []string{}
	for _, e := range eps {
		out = append(out, e.Address)
	}
	return out
}

func TestParseAdminClusters(t *testing.T) {
	m, err := ParseAdminClusters([]byte(adminJSON))
	if err != nil {
		t.Fatal(err)
	}
	got := addrs(m["outbound|8000||qwen.llm.svc.cluster.local"])
	want := []string{"10.0.1.1:8000", "10.0.1.6:8000", "[fd00::8]:8000"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("qwen endpoints = %v, want %v", got, want)
	}
	if got := addrs(m["BlackHoleCluster"]); len(got) != 0 {
		t.Fatalf("BlackHoleCluster = %v, want none", got)
	}
	if _, ok := m["BlackHoleCluster"]; !ok {
		t.Fatal("a cluster without hosts must still be known")
	}
	if got := addrs(m["outbound|8000||static.llm.svc.cluster.local"]); !reflect.DeepEqual(got, []string{"10.0.2.1:9000"}) {
		t.Fatalf("host without health status should be routable, got %v", got)
	}
	if _, err := ParseAdminClusters([]byte(`{"cluster_statuses": [`)); err == nil {
		t.Fatal("truncated JSON must fail")
	}
}

func TestAdminPollerAgainstAdminServer(t *testing.T) {
	var mu sync.Mutex
	body := adminJSON
	status := http.StatusOK
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/clusters" || r.URL.Query().Get("format") != "json" {
			http.Error(w, "unexpected "+r.URL.String(), http.StatusNotFound)
			return
		}
		hits.Add(1)
		mu.Lock()
		defer mu.Unlock()
		w.Header().Set("content-type", "application/json")
		w.WriteHeader(status)
		_, _ = w.Write([]byte(body))
	}))
	defer srv.Close()

	p, err := NewAdminPoller(AdminOptions{Address: srv.URL, Refresh: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	waitFor(t, p.Ready)
	const qwen = "outbound|8000||qwen.llm.svc.cluster.local"
	if got := addrs(p.Endpoints(qwen)); len(got) != 3 {
		t.Fatalf("endpoints = %v", got)
	}
	if got, want := addrs(Append(nil, p, qwen)), addrs(p.Endpoints(qwen)); !slices.Equal(got, want) {
		t.Fatalf("Append = %v, Endpoints = %v", got, want)
	}
	if got := p.Endpoints("unknown"); len(got) != 0 {
		t.Fatalf("unknown cluster = %v", got)
	}

	// A pod scales in: the next poll drops it.
	mu.Lock()
	body = strings.Replace(adminJSON, `"address": "10.0.1.6"`, `"address": "10.0.1.6", "ignored": 1`, 1)
	body = strings.Replace(body, `"DEGRADED"`, `"UNHEALTHY"`, 1)
	mu.Unlock()
	waitFor(t, func() bool { return len(p.Endpoints(qwen)) == 2 })

	// The admin breaks: the last snapshot stays.
	mu.Lock()
	status = http.StatusServiceUnavailable
	mu.Unlock()
	before, _ := p.Stats()
	waitFor(t, func() bool { polls, fails := p.Stats(); return polls > before+2 && fails >= 2 })
	if got := len(p.Endpoints(qwen)); got != 2 {
		t.Fatalf("after admin failure endpoints = %d, want the last snapshot (2)", got)
	}

	// Mutating a returned slice must not leak into the snapshot.
	eps := p.Endpoints(qwen)
	eps[0].Address = "1.2.3.4:1"
	if p.Endpoints(qwen)[0].Address == "1.2.3.4:1" {
		t.Fatal("Endpoints must return a copy")
	}
	eps = Append(eps[:0], p, qwen)
	eps[0].Address = "1.2.3.4:1"
	if p.Endpoints(qwen)[0].Address == "1.2.3.4:1" {
		t.Fatal("Append must copy")
	}

	p.Close()
	if pollsAfterStop(p, &hits, 20*time.Millisecond) {
		t.Fatal("poller kept polling after Close")
	}
}

func TestAdminPollerBadAddress(t *testing.T) {
	for _, a := range []string{"ftp://x", "http://", "://"} {
		if _, err := NewAdminPoller(AdminOptions{Address: a}); err == nil {
			t.Errorf("address %q accepted", a)
		}
	}
	if _, err := NewAdminPoller(AdminOptions{Refresh: -time.Second}); err == nil {
		t.Error("negative refresh accepted")
	}
}

func TestPollOnceUnreachable(t *testing.T) {
	srv := httptest.NewServer(http.NotFoundHandler())
	url := srv.URL
	srv.Close()
	p, err := NewAdminPoller(AdminOptions{Address: url, Refresh: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if err := p.PollOnce(context.Background()); err == nil {
		t.Fatal("poll of a closed port succeeded")
	}
	if p.Ready() || p.Endpoints("x") != nil {
		t.Fatal("no snapshot expected")
	}
}

func TestRegistrySharesOnePollerPerAddress(t *testing.T) {
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits.Add(1)
		_, _ = w.Write([]byte(adminJSON))
	}))
	defer srv.Close()
	reg := NewRegistry(nil)
	a, relA, err := reg.Acquire(srv.URL, 10*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	b, relB, err := reg.Acquire(srv.URL, 10*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if a != b || reg.Len() != 1 {
		t.Fatalf("two configs got two pollers (len %d)", reg.Len())
	}
	waitFor(t, a.Ready)
	relA()
	relA() // idempotent
	if reg.Len() != 1 {
		t.Fatal("poller stopped while still in use")
	}
	relB()
	if reg.Len() != 0 {
		t.Fatal("poller not stopped after last release")
	}
	if pollsAfterStop(a, &hits, 10*time.Millisecond) {
		t.Fatal("released poller still polling")
	}
	c, relC, err := reg.Acquire(srv.URL, 10*time.Millisecond)
	if err != nil || c == a {
		t.Fatalf("re-acquire after release should start a new poller (err %v)", err)
	}
	relC()
	if _, _, err := reg.Acquire("ftp://nope", 0); err == nil {
		t.Fatal("bad address accepted")
	}
}

func TestStaticAndLayered(t *testing.T) {
	s, err := NewStatic(map[string][]string{
		"tiny-pool": {"127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9001", "::1:9003"},
		"empty":     {},
	})
	if err == nil {
		t.Fatal("'::1:9003' is ambiguous and must be refused")
	}
	s, err = NewStatic(map[string][]string{
		"tiny-pool": {"127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9001", "[::1]:9003"},
		"empty":     {},
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := addrs(s.Endpoints("tiny-pool")); !reflect.DeepEqual(got, []string{"127.0.0.1:9001", "127.0.0.1:9002", "[::1]:9003"}) {
		t.Fatalf("static = %v", got)
	}
	for _, bad := range []string{"localhost:9001", "127.0.0.1", "127.0.0.1:0", "10.0.0.1:99999", ""} {
		if _, err := NewStatic(map[string][]string{"c": {bad}}); err == nil {
			t.Errorf("address %q accepted", bad)
		}
	}
	dyn, _ := NewStatic(map[string][]string{"empty": {"10.0.0.1:1"}, "other": {"10.0.0.2:2"}})
	l := Layered{Pinned: s, Dynamic: dyn}
	if got := l.Endpoints("empty"); len(got) != 0 {
		t.Fatalf("a pinned empty list must win over discovery, got %v", got)
	}
	if got := addrs(l.Endpoints("other")); !reflect.DeepEqual(got, []string{"10.0.0.2:2"}) {
		t.Fatalf("unpinned cluster = %v", got)
	}
	if got := (Layered{}).Endpoints("x"); got != nil {
		t.Fatalf("empty layered = %v", got)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	wait.For(t, 5*time.Second, "the condition", cond)
}

// pollsAfterStop reports whether a stopped poller (its goroutine gone:
// Close waits for it) polls again within a few refresh periods, or its
// server sees more requests than the poller made before it stopped (a
// poll that the stop cancelled may still arrive; it was counted).
func pollsAfterStop(p *AdminPoller, hits *atomic.Int64, refresh time.Duration) bool {
	made, _ := p.Stats()
	return wait.Until(4*refresh, func() bool {
		polls, _ := p.Stats()
		return polls != made || hits.Load() > int64(made)
	})
}
