package kvcache

import (
	"slices"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

func mustNew(t *testing.T, lim Limits) *Manager {
	t.Helper()
	m, err := New(lim)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

func toks(n, base int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = base + i
	}
	return out
}

func TestLimitsValidate(t *testing.T) {
	for _, l := range []Limits{{Threshold: 0}, {Threshold: 1.5}, {Threshold: 0.8, MaxItems: -1}} {
		if _, err := New(l); err == nil {
			t.Errorf("New(%+v) accepted bad limits", l)
		}
	}
}

func TestMatchLongestPrefix(t *testing.T) {
	m := mustNew(t, Limits{Threshold: 0.8})
	sys := toks(100, 1000)
	a := append(slices.Clone(sys), toks(50, 1)...)
	b := append(slices.Clone(sys), toks(80, 5000)...)
	m.Add(&Entry{ID: "a", Seq: 0, Tokens: a})
	m.Add(&Entry{ID: "b", Seq: 1, Tokens: b})

	q := append(slices.Clone(b[:150]), 7, 7, 7)
	e, n := m.Match(q)
	if e == nil || e.ID != "b" || n != 150 {
		t.Fatalf("Match = %v,%d want b,150", e, n)
	}
	q2 := append(slices.Clone(sys), 9)
	e, n = m.Match(q2)
	if n != 100 {
		t.Fatalf("shared system prompt: n = %d want 100", n)
	}
	if e.ID != "b" { // both match 100; b was added last so it is the most recent
		t.Fatalf("tie went to %s, want most recent b", e.ID)
	}
	m.Touch("a")
	if e, _ = m.Match(q2); e.ID != "a" {
		t.Fatalf("tie after touching a went to %s", e.ID)
	}
	m.SetInUse("b", true)
	if e, n = m.Match(q); e.ID != "b" || n != 150 {
		t.Fatalf("a running entry's written cells match too: got %s,%d", e.ID, n)
	}
	m.Touch("b")
	if e, _ = m.Match(q2); e.ID != "a" {
		t.Fatalf("on a tie the idle entry wins, got %s", e.ID)
	}
	if e, n = m.Match([]int{-5}); e != nil || n != 0 {
		t.Fatalf("no common prefix: got %v,%d", e, n)
	}
}

func TestEvictionIsLRUAndSparesRunning(t *testing.T) {
	// 10 bytes per token, 1000 bytes limit, threshold 0.8 -> above 80 tokens evicts.
	m := mustNew(t, Limits{MaxBytes: 1000, BytesPerToken: 10, Threshold: 0.8})
	m.Add(&Entry{ID: "old", Tokens: toks(30, 0)})
	m.Add(&Entry{ID: "running", Tokens: toks(30, 100), InUse: true})
	m.Add(&Entry{ID: "mid", Tokens: toks(20, 200)})
	m.Add(&Entry{ID: "new", Tokens: toks(20, 300)})
	if m.Items() != 100 || m.Bytes() != 1000 || !m.OverThreshold() {
		t.Fatalf("items %d bytes %d over %v", m.Items(), m.Bytes(), m.OverThreshold())
	}
	ev := m.EvictOverThreshold()
	var ids []string
	for _, e := range ev {
		ids = append(ids, e.Entry.ID)
	}
	if !slices.Equal(ids, []string{"old"}) {
		t.Fatalf("evicted %v, want [old]", ids)
	}
	if m.Items() != 70 || m.OverThreshold() {
		t.Fatalf("after eviction items %d over %v", m.Items(), m.OverThreshold())
	}
	// Grow the running entry far past the limit: only idle entries go, and
	// the running one stays even though usage remains above the threshold.
	m.Append("running", toks(200, 400)...)
	ev = m.EvictOverThreshold()
	if len(ev) != 2 || ev[0].Entry.ID != "mid" || ev[1].Entry.ID != "new" {
		t.Fatalf("second eviction %v", ev)
	}
	if _, ok := m.Get("running"); !ok || !m.OverThreshold() {
		t.Fatal("running entry evicted, or usage fell without it")
	}
	if m.Victim() != nil {
		t.Fatal("Victim returned the running entry")
	}
}

func TestVictimPrefersRedundantCopiesOfASharedPrefix(t *testing.T) {
	m := mustNew(t, Limits{Threshold: 0.8})
	doc := toks(100, 0)
	withTail := func(tail int) []int { return append(slices.Clone(doc), toks(10, tail)...) }
	// Oldest first: a lone conversation, then three questions about one
	// document (same 100 tokens, different 10-token tails), then another lone one.
	m.Add(&Entry{ID: "lone-old", Tokens: toks(50, 1000)})
	m.Add(&Entry{ID: "doc-q1", Tokens: withTail(2000)})
	m.Add(&Entry{ID: "doc-q2", Tokens: withTail(3000)})
	m.Add(&Entry{ID: "doc-q3", Tokens: withTail(4000)})
	m.Add(&Entry{ID: "lone-new", Tokens: toks(50, 5000)})
	var order []string
	for v := m.Victim(); v != nil; v = m.Victim() {
		order = append(order, v.ID)
		m.Remove(v.ID)
	}
	// The document's copies go oldest first until one is left; that one is
	// then ordinary LRU among the rest.
	want := []string{"doc-q1", "doc-q2", "lone-old", "doc-q3", "lone-new"}
	if !slices.Equal(order, want) {
		t.Fatalf("eviction order %v, want %v", order, want)
	}
	m.Add(&Entry{ID: "a", Tokens: withTail(1)})
	m.Add(&Entry{ID: "b", Tokens: withTail(2), InUse: true})
	if v := m.Victim(); v == nil || v.ID != "a" {
		t.Fatalf("a prefix a running entry holds makes the idle copy redundant; got %v", v)
	}
	if v := m.Victim("a"); v != nil {
		t.Fatalf("excluded and running entries are not victims; got %v", v.ID)
	}
}

func TestItemsLimit(t *testing.T) {
	m := mustNew(t, Limits{MaxItems: 10, Threshold: 0.5})
	m.Add(&Entry{ID: "a", Tokens: toks(5, 0)})
	if m.OverThreshold() {
		t.Fatal("5 items of 10 at threshold 0.5 is not over")
	}
	m.Append("a", 1)
	if !m.OverThreshold() {
		t.Fatal("6 items of 10 at threshold 0.5 is over")
	}
	m.Truncate("a", 2)
	if m.Items() != 2 || m.OverThreshold() {
		t.Fatalf("after truncate items %d", m.Items())
	}
}

func TestHashRefcountsReportOnlyUnheldHashes(t *testing.T) {
	m := mustNew(t, Limits{Threshold: 0.8})
	m.Add(&Entry{ID: "a", Hashes: []prefix.Hash{1, 2, 3}})
	m.Add(&Entry{ID: "b", Hashes: []prefix.Hash{1, 2, 4}})
	_, freed := m.Remove("a")
	if !slices.Equal(freed, []prefix.Hash{3}) {
		t.Fatalf("removing a freed %v, want [3] (1 and 2 are still held by b)", freed)
	}
	if m.Refs(1) != 1 || m.Refs(3) != 0 {
		t.Fatalf("refs 1=%d 3=%d", m.Refs(1), m.Refs(3))
	}
	// A take-over: b's conversation continues as c with a longer prompt.
	freed = m.SetHashes("b", []prefix.Hash{1, 2, 4, 5})
	if len(freed) != 0 {
		t.Fatalf("extending hashes freed %v", freed)
	}
	freed = m.SetHashes("b", []prefix.Hash{9})
	slices.Sort(freed)
	if !slices.Equal(freed, []prefix.Hash{1, 2, 4, 5}) {
		t.Fatalf("replacing hashes freed %v", freed)
	}
	_, freed = m.Remove("b")
	if !slices.Equal(freed, []prefix.Hash{9}) {
		t.Fatalf("removing b freed %v", freed)
	}
	if _, freed = m.Remove("b"); freed != nil {
		t.Fatal("second remove freed hashes")
	}
}

func TestAddRejectsDuplicates(t *testing.T) {
	m := mustNew(t, Limits{Threshold: 0.8})
	if err := m.Add(&Entry{ID: "x", Tokens: toks(3, 0)}); err != nil {
		t.Fatal(err)
	}
	if err := m.Add(&Entry{ID: "x"}); err == nil {
		t.Fatal("duplicate id accepted")
	}
	if err := m.Add(&Entry{}); err == nil {
		t.Fatal("empty id accepted")
	}
	if m.Len() != 1 || m.Idle() != 1 || m.Items() != 3 {
		t.Fatalf("len %d idle %d items %d", m.Len(), m.Idle(), m.Items())
	}
}
