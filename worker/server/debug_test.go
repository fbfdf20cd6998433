package server

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"slices"
	"sync"
	"testing"
	"time"

	filteropenai "github.com/istio-llm-filter/istio-llm-filter/filter/transcode/openai"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
	"github.com/istio-llm-filter/istio-llm-filter/worker/scheduler"
)

func kvPrefixesOf(t *testing.T, w *worker) KVPrefixes {
	t.Helper()
	resp, err := http.Get(w.url + PathDebugKVPrefixes)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%s: status %d", PathDebugKVPrefixes, resp.StatusCode)
	}
	var out KVPrefixes
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		t.Fatal(err)
	}
	return out
}

// gatewayHashes are the hashes the router indexes a chat request by.
func gatewayHashes(t *testing.T, m []map[string]string) []string {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"model": "tiny", "messages": m})
	model, canon, err := filteropenai.Canonical("/v1/chat/completions", body)
	if err != nil {
		t.Fatal(err)
	}
	return prefix.Wire(prefix.Hasher{}.Sum(model, canon))
}

func sortedUnion(sets ...[]string) []string {
	var out []string
	for _, s := range sets {
		out = append(out, s...)
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// TestDebugKVPrefixesIsTheWorkersOwnView runs real requests on a llama.cpp
// worker and checks the listing against the router's hashes of the same
// requests: finished conversations are listed under exactly the gateway's
// hashes, a next turn adds its own, and an eviction empties the listing.
func TestDebugKVPrefixesIsTheWorkersOwnView(t *testing.T) {
	w := startWorker(t, opts{})
	if got := kvPrefixesOf(t, w); got.Entries != 0 || len(got.Prefixes) != 0 {
		t.Fatalf("fresh worker lists %+v", got)
	}
	turn1 := msgs("system", "You are terse.", "user", longText(1300, "first"))
	a := chat(t, w, turn1, nil)
	other := msgs("user", longText(700, "other"))
	chat(t, w, other, nil)
	h1, ho := gatewayHashes(t, turn1), gatewayHashes(t, other)
	if len(h1) < 3 {
		t.Fatalf("turn 1 spans %d blocks; the test needs several", len(h1))
	}
	got := kvPrefixesOf(t, w)
	if got.Entries != 2 || got.InUse != 0 || !slices.Equal(got.Prefixes, sortedUnion(h1, ho)) {
		t.Fatalf("after two conversations: %+v, want 2 idle entries holding %v", got, sortedUnion(h1, ho))
	}

	turn2 := append(slices.Clone(turn1), msgs("assistant", a.Choices[0].Message.Content, "user", "and tomorrow?")...)
	chat(t, w, turn2, nil)
	h2 := gatewayHashes(t, turn2)
	// Turn 2 either took turn 1's entry over (its tokens were a prefix of
	// turn 2's) or shared its cells into a new one; the listing must say
	// which, in the router's hashes.
	got = kvPrefixesOf(t, w)
	want := sortedUnion(h2, ho)
	if got.Entries == 3 {
		want = sortedUnion(h1, h2, ho)
	}
	if got.Entries < 2 || got.Entries > 3 || !slices.Equal(got.Prefixes, want) {
		t.Fatalf("after turn 2: %+v, want %v", got, want)
	}

	w.inspect(t, func(v scheduler.View) {
		for v.Owner.EvictOne("test") {
		}
	})
	if got := kvPrefixesOf(t, w); got.Entries != 0 || len(got.Prefixes) != 0 {
		t.Fatalf("after evicting everything: %+v", got)
	}
}

// TestDebugKVPrefixesListsAcceptedRequestsAsPending holds a stream open on
// a real worker and checks that its prompt's hashes — the ones the router
// saved when it routed the request — are listed as pending while it runs,
// and no longer once it is answered.
func TestDebugKVPrefixesListsAcceptedRequestsAsPending(t *testing.T) {
	w := startWorker(t, opts{})
	m := msgs("user", longText(900, "pending"))
	body, _ := json.Marshal(map[string]any{"model": "tiny", "messages": m, "stream": true, "max_tokens": 400, "ignore_eos": true})
	resp, err := http.Post(w.url+"/v1/chat/completions", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if _, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil { // the first event: accepted and running
		t.Fatal(err)
	}
	want := gatewayHashes(t, m)
	slices.Sort(want)
	if got := kvPrefixesOf(t, w); !slices.Equal(got.Pending, want) || got.InUse != 1 {
		t.Fatalf("while streaming: %+v, want pending %v and one entry in use", got, want)
	}
	if _, err := io.Copy(io.Discard, resp.Body); err != nil {
		t.Fatal(err)
	}
	waitIdle(t, w)
	if got := kvPrefixesOf(t, w); len(got.Pending) != 0 || !slices.Equal(got.Prefixes, want) {
		t.Fatalf("after the answer: %+v, want no pending and %v held", got, want)
	}
}

// TestDebugKVPrefixesListsEvictionsAndRefusalsWithTheirTimes runs real
// requests on a llama.cpp worker that reports to a metadata center: the
// prefixes it evicts are listed with when, and with when the center
// acknowledged their report once it did; the prompt hashes of a request
// it refused (429) are listed with when. A checker needs both to tell an
// index entry on its way out from a wrong one (bench/chaos, Classify).
func TestDebugKVPrefixesListsEvictionsAndRefusalsWithTheirTimes(t *testing.T) {
	mc, rep := reportingTo(t)
	w := startWorker(t, opts{mc: rep, sched: scheduler.Config{MaxRunning: 1, MaxQueue: 1, MaxOutputTokens: 4000}})

	m := msgs("user", longText(900, "evicted"))
	chat(t, w, m, nil)
	want := gatewayHashes(t, m)
	slices.Sort(want)
	if got := kvPrefixesOf(t, w); !slices.Equal(got.Prefixes, want) || len(got.Evicted) != 0 {
		t.Fatalf("after one conversation: %+v, want %v held and nothing evicted", got, want)
	}
	before := time.Now().UnixMilli()
	w.inspect(t, func(v scheduler.View) {
		for v.Owner.EvictOne("test") {
		}
	})
	after := time.Now().UnixMilli()
	if err := rep.Flush(context.Background()); err != nil {
		t.Fatal(err)
	}
	acked := time.Now().UnixMilli()
	got := kvPrefixesOf(t, w)
	var evicted []string
	for _, g := range got.Evicted {
		evicted = append(evicted, g.Hash)
		if g.At < before || g.At > after || g.Reported < g.At || g.Reported > acked {
			t.Errorf("%s evicted at %d (evicting %d..%d), reported at %d (acknowledged by %d)", g.Hash, g.At, before, after, g.Reported, acked)
		}
		mc.mu.Lock()
		sent := mc.hashes[g.Hash]
		mc.mu.Unlock()
		if !sent {
			t.Errorf("%s listed as reported, but the center never got it", g.Hash)
		}
	}
	slices.Sort(evicted)
	if len(got.Prefixes) != 0 || !slices.Equal(evicted, want) || got.EvictedSince > before {
		t.Fatalf("after evicting everything: %+v, want %v evicted, listed since before %d", got, want, before)
	}

	// One request running, one queued: the next is refused. The second is
	// sent only once the first runs; sent together, both could find the
	// first still queued and the second be refused instead.
	long, _ := json.Marshal(map[string]any{"model": "tiny", "messages": msgs("user", "go"), "max_tokens": 4000, "ignore_eos": true})
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for _, until := range []func(scheduler.Stats) bool{
		func(s scheduler.Stats) bool { return s.Running == 1 },
		func(s scheduler.Stats) bool { return s.Running == 1 && s.Queued == 1 },
	} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequestWithContext(ctx, "POST", w.url+"/v1/chat/completions", bytes.NewReader(long))
			if resp, err := http.DefaultClient.Do(req); err == nil {
				resp.Body.Close()
			}
		}()
		var s scheduler.Stats
		if !wait.Until(10*time.Second, func() bool { s = w.sched.Stats(); return until(s) }) {
			t.Fatalf("never one running and one queued: %+v", s)
		}
	}
	refused := msgs("user", longText(500, "refused"))
	before = time.Now().UnixMilli()
	if resp, out := post(t, w.url, "/v1/chat/completions", map[string]any{"model": "tiny", "messages": refused}); resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("answered %d: %s", resp.StatusCode, out)
	}
	after = time.Now().UnixMilli()
	got = kvPrefixesOf(t, w)
	cancel()
	wg.Wait()
	var hs []string
	for _, g := range got.Refused {
		hs = append(hs, g.Hash)
		if g.At < before || g.At > after {
			t.Errorf("%s refused at %d, the request ran %d..%d", g.Hash, g.At, before, after)
		}
	}
	slices.Sort(hs)
	if wantR := gatewayHashes(t, refused); !slices.Equal(hs, sortedUnion(wantR)) {
		t.Fatalf("refused %v, want %v", hs, sortedUnion(wantR))
	}
	waitIdle(t, w)
}
