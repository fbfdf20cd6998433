package lifecycle

import (
	"context"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing/routingtest"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

func TestLifecycleAgainstMetadataCenter(t *testing.T) {
	ts := center(t)
	m := &counts{}
	e := newGateway(t, configFor(t, ts.URL, ""), routing.Options{Metrics: m}, nil)
	mc, _ := client.New(client.Options{Address: ts.URL, QueryTimeout: 2 * time.Second})
	ctx := context.Background()

	system := strings.Repeat("You are a careful assistant who answers in French. ", 8)
	body := chatBody(system, "Bonjour ?")
	d, err := e.Decide(ctx, hdr{":path": "/v1/chat/completions", "x-request-id": "trace-1"}, body)
	if err != nil {
		t.Fatal(err)
	}
	if d.TraceID != "trace-1" || d.Model != "qwen" || d.Cluster != cluster || d.SceneName != "chat" || d.Backend != "vllm" ||
		d.Policy != "cache_aware" || !d.Stream || d.Degraded || d.CacheRatio != 0 || d.Body != nil || d.Path != "" || d.Response != nil ||
		d.Candidates != 3 || d.RequestID == "" {
		t.Fatalf("decision %+v", d)
	}
	if !contains(pods, d.Host) {
		t.Fatalf("host %q is not a pod", d.Host)
	}
	// The hashes are prefix's over the canonical chat, seeded by model.
	canon := prefix.CanonicalChat([]prefix.Message{
		{Role: "system", Parts: []prefix.Part{{Type: "text", Text: system}}},
		{Role: "user", Parts: []prefix.Part{{Type: "text", Text: "Bonjour ?"}}},
	})
	if want := prefix.Wire(prefix.Hasher{ChunkSize: 64}.Sum("qwen", canon)); fmt.Sprint(want) != fmt.Sprint(d.Hashes) || d.PromptLength != len(canon) {
		t.Fatalf("hashes %v / %d, want %v / %d", d.Hashes, d.PromptLength, want, len(canon))
	}

	e.Started(d)
	e.Started(d) // once only
	eventually(t, "the lease to reach the metadata center", func() bool {
		ans, err := mc.Route(ctx, cluster, nil)
		// Nothing cached yet: the whole prompt is prefill to do.
		return err == nil && ans.Load[d.Host].TotalReqs == 1 && ans.Load[d.Host].PromptLength == int64(d.PromptLength) &&
			d.PrefillLength == d.PromptLength
	})
	eventually(t, "the add to be acknowledged locally", func() bool {
		n, u := e.InFlight(cluster, d.Host)
		return n == 1 && u == 0
	})
	e.FirstToken(d)
	e.Saved(d)
	eventually(t, "first token and cache save", func() bool {
		ans, err := mc.Route(ctx, cluster, d.Hashes)
		return err == nil && ans.Load[d.Host].PromptLength == 0 && len(ans.Cache) == 1 &&
			ans.Cache[0].Host == d.Host && ans.Cache[0].Length == len(d.Hashes)
	})

	// The same system prompt with a new question goes where the prefix is,
	// though that pod is the only busy one.
	d2, err := e.Decide(ctx, chatPath(), chatBody(system, "Et maintenant ?"))
	if err != nil {
		t.Fatal(err)
	}
	if d2.Host != d.Host || d2.CacheRatio <= 0.5 || d2.CacheRatio >= 1 {
		t.Fatalf("follow-up went to %s with ratio %v (first %s)", d2.Host, d2.CacheRatio, d.Host)
	}
	if d2.RequestID == d.RequestID {
		t.Fatal("request ids repeat")
	}
	// Its prefill load is only the part the pod does not hold.
	if want := int(math.Round(float64(d2.PromptLength) * (1 - d2.CacheRatio))); d2.PrefillLength != want || want >= d2.PromptLength/2 {
		t.Fatalf("prefill length %d of a %d-byte prompt with ratio %v, want %d", d2.PrefillLength, d2.PromptLength, d2.CacheRatio, want)
	}

	e.Done(d)
	e.Done(d)
	eventually(t, "the lease to be deleted", func() bool {
		ans, err := mc.Route(ctx, cluster, nil)
		return err == nil && ans.Load[d.Host].TotalReqs == 0
	})
	if n, _ := e.InFlight(cluster, d.Host); n != 0 {
		t.Fatalf("local in-flight %d after Done", n)
	}
	if m.Get("routed") != 2 || m.Get("cache_hit_routes") != 1 || m.Get("fallbacks") != 0 || m.Get("async_errors") != 0 {
		t.Fatalf("metrics %v", m)
	}
}

func contains(list []string, s string) bool {
	for _, v := range list {
		if v == s {
			return true
		}
	}
	return false
}

func TestLifecycleCallsNeedStarted(t *testing.T) {
	ts := center(t)
	e := newGateway(t, configFor(t, ts.URL, ""), routing.Options{}, nil)
	d, err := e.Decide(context.Background(), chatPath(), chatBody("s", "u"))
	if err != nil {
		t.Fatal(err)
	}
	// A decision the filter gave up on (never Started) owes nothing.
	e.FirstToken(d)
	e.Saved(d)
	e.Done(d)
	e.Started(nil)
	e.Done(nil)
	if n, _ := e.InFlight(cluster, d.Host); n != 0 || e.Pending() != 0 {
		t.Fatalf("in flight %d pending %d", n, e.Pending())
	}
}

func TestBurstWithoutMetadataSpreadsLocally(t *testing.T) {
	// No metadata center at all: cache_aware still spreads a burst evenly
	// thanks to local in-flight accounting.
	e := newGateway(t, configFor(t, "", ""), routing.Options{}, nil)
	per := map[string]int{}
	var ds []*Request
	for range 30 {
		d, err := e.Decide(context.Background(), chatPath(), chatBody("same", "same"))
		if err != nil {
			t.Fatal(err)
		}
		e.Started(d)
		per[d.Host]++
		ds = append(ds, d)
	}
	for _, p := range pods {
		if per[p] != 10 {
			t.Fatalf("burst spread %v", per)
		}
	}
	for _, d := range ds {
		e.Done(d)
	}
	for _, p := range pods {
		if n, _ := e.InFlight(cluster, p); n != 0 {
			t.Fatalf("%s still has %d in flight", p, n)
		}
	}
}

type blockingUpdater struct{ release chan struct{} }

func (b blockingUpdater) wait(ctx context.Context) error {
	select {
	case <-b.release:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
func (b blockingUpdater) AddRequest(ctx context.Context, _ api.AddRequest) error { return b.wait(ctx) }
func (b blockingUpdater) FirstToken(ctx context.Context, _ api.RequestRef) error { return b.wait(ctx) }
func (b blockingUpdater) DeleteRequest(ctx context.Context, _ api.RequestRef) error {
	return b.wait(ctx)
}
func (b blockingUpdater) SaveCache(ctx context.Context, _ api.CacheSave) error { return b.wait(ctx) }
func (b blockingUpdater) RetractCache(ctx context.Context, _ api.CacheRetract) error {
	return b.wait(ctx)
}
func (b blockingUpdater) Batch(ctx context.Context, _ []api.BatchOp) error { return b.wait(ctx) }

func TestUpdatesDropInsteadOfBlocking(t *testing.T) {
	m := &counts{}
	u := blockingUpdater{release: make(chan struct{})}
	cfg := configFor(t, "", "async: {queue_size: 2, workers: 1, drain_timeout: 1s, batch_window: 0s}")
	e := newGateway(t, cfg, routing.Options{Metrics: m}, u)
	start := time.Now()
	var ds []*Request
	for range 10 {
		d, err := e.Decide(context.Background(), chatPath(), chatBody("s", "u"))
		if err != nil {
			t.Fatal(err)
		}
		e.Started(d)
		ds = append(ds, d)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("lifecycle reports blocked for %v", took)
	}
	// One running, two queued: seven adds dropped. Their requests stay
	// counted locally (unacknowledged) until Done.
	eventually(t, "drops to be counted", func() bool { return m.Get("async_dropped") >= 7 })
	var unacked int64
	for _, p := range pods {
		_, u := e.InFlight(cluster, p)
		unacked += u
	}
	if unacked != 10 {
		t.Fatalf("unacknowledged %d, want 10", unacked)
	}
	close(u.release)
	for _, d := range ds {
		e.Done(d)
	}
	e.Close()
	for _, p := range pods {
		if n, _ := e.InFlight(cluster, p); n != 0 {
			t.Fatalf("%s: %d in flight after Done", p, n)
		}
	}
}

func TestCloseDrainsQueuedUpdates(t *testing.T) {
	ts := center(t)
	e := newGateway(t, configFor(t, ts.URL, ""), routing.Options{}, nil)
	var ds []*Request
	for range 20 {
		d, err := e.Decide(context.Background(), chatPath(), chatBody("s", "u"))
		if err != nil {
			t.Fatal(err)
		}
		e.Started(d)
		ds = append(ds, d)
	}
	e.Close()
	mc, _ := client.New(client.Options{Address: ts.URL})
	ans, err := mc.Route(context.Background(), cluster, nil)
	if err != nil {
		t.Fatal(err)
	}
	var total int64
	for _, st := range ans.Load {
		total += st.TotalReqs
	}
	if total != 20 {
		t.Fatalf("after Close the metadata center counts %d of 20 requests", total)
	}
	// After Close, reports are dropped, never block or panic.
	e.Done(ds[0])
}

func TestBurstBetweenMetadataUpdatesSpreads(t *testing.T) {
	// The metadata center answers (all pods idle, the same prefix cached
	// nowhere) but none of the burst's adds has landed yet: every decision
	// sees the same stale view, and only local accounting spreads them.
	u := blockingUpdater{release: make(chan struct{})}
	e := newGateway(t, configFor(t, "", ""), routing.Options{Querier: &routingtest.Querier{Answer: api.RouteAnswer{Load: api.LoadStats{}}}}, u)
	per := map[string]int{}
	var ds []*Request
	for range 30 {
		d, err := e.Decide(context.Background(), chatPath(), chatBody("one hot system prompt", "same question"))
		if err != nil || d.Degraded {
			t.Fatalf("%+v %v", d, err)
		}
		e.Started(d)
		per[d.Host]++
		ds = append(ds, d)
	}
	for _, p := range pods {
		if per[p] != 10 {
			t.Fatalf("burst of 30 over 3 pods: %v", per)
		}
	}
	close(u.release)
	for _, d := range ds {
		e.Done(d)
	}
}
