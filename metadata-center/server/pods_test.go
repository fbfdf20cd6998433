package server_test

import (
	"reflect"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/podsignals"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/storetest"
)

// TestPodRegistrations: a registration riding on a signal report is
// answered by the route query (labels and adapters, beside load and cache)
// and by GET /v1/pods (everything, with the time left); a report without
// one leaves it alone; bad registrations get 400 in the error format.
func TestPodRegistrations(t *testing.T) {
	for _, st := range storetest.Stores() {
		t.Run(st.Name, func(t *testing.T) {
			c := serve(t, st.New(t), server.Options{})
			const a, b = "10.0.0.1:8000", "10.0.0.2:8000"
			reg := &api.PodRegistration{Models: []string{"tiny"}, Labels: map[string]string{"pool": "gold"}, Adapters: []string{"sql"}, TTLMS: 60_000}
			c.ok("POST", api.PathPodSignals, api.PodReport{Cluster: cl, Host: "10.0.0.1:08000", Running: 1, Register: reg}, nil)
			c.ok("POST", api.PathPodSignals, api.PodReport{Cluster: cl, Host: b, Running: 2}, nil) // never registers
			c.ok("POST", api.PathPodSignals, api.PodReport{Cluster: cl, Host: a, Running: 3}, nil) // keeps a's registration
			c.ok("POST", api.PathLoadStats, api.AddRequest{Cluster: cl, Host: b, RequestID: "r", PromptLength: 5}, nil)
			var ans api.RouteAnswer
			c.ok("POST", api.PathRouteQuery, api.RouteQuery{Cluster: cl, Hashes: hexes(0, 2)}, &ans)
			if len(ans.Pods) != 1 || ans.Pods[a].Labels["pool"] != "gold" || len(ans.Pods[a].Adapters) != 1 || ans.Pods[a].Adapters[0] != "sql" {
				t.Fatalf("route pods %+v", ans.Pods)
			}
			if ans.Load[b].TotalReqs != 1 || ans.Signals[a].Running != 3 {
				t.Fatalf("route load/signals beside pods: %+v", ans)
			}
			var pods map[string]api.PodRegistration
			c.ok("GET", api.PathPods+"?cluster="+cl, nil, &pods)
			if len(pods) != 1 || pods[a].Models[0] != "tiny" || pods[a].TTLMS <= 50_000 || pods[a].TTLMS > 60_000 {
				t.Fatalf("GET pods %+v", pods)
			}
			var none map[string]api.PodRegistration
			c.ok("GET", api.PathPods+"?cluster=nobody", nil, &none)
			if none == nil || len(none) != 0 {
				t.Fatalf("GET pods of a cluster nobody registered in: %+v, want {}", none)
			}
			long := strings.Repeat("x", 300)
			for _, bad := range []struct {
				reg map[string]any
				msg string
			}{
				{map[string]any{"ttl_ms": 10}, "register.ttl_ms must be within"},
				{map[string]any{"labels": map[string]string{"": "v"}}, "register.labels: key"},
				{map[string]any{"labels": map[string]string{"k": long}}, `register.labels["k"]`},
				{map[string]any{"adapters": []string{"sql", "sql"}}, `register.adapters: "sql" given twice`},
				{map[string]any{"models": []string{""}}, "register.models: name"},
				{map[string]any{"adapters": "sql"}, `field "register.adapters"`},
			} {
				c.fails("POST", api.PathPodSignals, map[string]any{"cluster": cl, "host": a, "register": bad.reg}, 400, "bad_request", bad.msg)
			}
			c.fails("GET", api.PathPods, nil, 400, "bad_request", "cluster")
			// Refused registrations changed nothing.
			c.ok("GET", api.PathPods+"?cluster="+cl, nil, &pods)
			if len(pods) != 1 || pods[a].Labels["pool"] != "gold" {
				t.Fatalf("after refused registrations: %+v", pods)
			}
		})
	}
}

// TestPodsAnnouncements: a gateway's announcement reaches the scraper's
// book, hosts in canonical form; bad announcements get 400 in the error
// format and record nothing; a server without a book answers 404.
func TestPodsAnnouncements(t *testing.T) {
	st := storetest.Stores()[0]
	book := podsignals.NewDiscovered()
	c := serve(t, st.New(t), server.Options{Discovered: book})
	c.ok("POST", api.PathPodsDiscovered, api.PodsAnnouncement{Cluster: cl, Backend: "vllm", Hosts: []string{"10.0.0.1:08000", "10.0.0.2:8000"}}, nil)
	want := []podsignals.Target{{Cluster: cl, Host: "10.0.0.1:8000", Backend: "vllm"}, {Cluster: cl, Host: "10.0.0.2:8000", Backend: "vllm"}}
	if got := book.Targets(); !reflect.DeepEqual(got, want) {
		t.Fatalf("book %+v, want %+v", got, want)
	}
	for _, bad := range []struct {
		a   map[string]any
		msg string
	}{
		{map[string]any{"backend": "vllm", "hosts": []string{"10.0.0.3:8000"}}, "cluster is required"},
		{map[string]any{"cluster": cl, "backend": "triton", "hosts": []string{"10.0.0.3:8000"}}, `backend "triton"`},
		{map[string]any{"cluster": cl, "backend": "vllm"}, "hosts: list 1 to 4096"},
		{map[string]any{"cluster": cl, "backend": "vllm", "hosts": []string{"pod-a:8000"}}, "hosts[0]"},
		{map[string]any{"cluster": cl, "backend": "vllm", "hosts": []string{"10.0.0.3:8000"}, "ttl_ms": 5}, "ttl_ms must be within"},
	} {
		c.fails("POST", api.PathPodsDiscovered, bad.a, 400, "bad_request", bad.msg)
	}
	if got := book.Targets(); len(got) != 2 {
		t.Fatalf("refused announcements recorded: %+v", got)
	}
	off := serve(t, st.New(t), server.Options{})
	off.fails("POST", api.PathPodsDiscovered, api.PodsAnnouncement{Cluster: cl, Backend: "vllm", Hosts: []string{"10.0.0.1:8000"}}, 404, "not_found", "does not scrape")
}
