package main

import (
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/bench/workload"
)

func TestVariantFlagResolvesLabelsToAPolicyAndItsRuleKeys(t *testing.T) {
	v := variantFlag{}
	if err := v.Set("ca-w1=cache_aware; tie_epsilon: 0.2, default_decode_step: 0.01"); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"nolabel", "=cache_aware", "x=", "x= ; tie_epsilon: 0.2"} {
		if err := v.Set(bad); err == nil {
			t.Errorf("Set(%q) accepted", bad)
		}
	}
	cases := []struct{ name, global, policy, rule string }{
		{"ca-w1", "", "cache_aware", "tie_epsilon: 0.2, default_decode_step: 0.01"},
		{"ca-w1", "candidate_percent: 20", "cache_aware", "candidate_percent: 20, tie_epsilon: 0.2, default_decode_step: 0.01"},
		{"epp", "candidate_percent: 20", "epp", "candidate_percent: 20"},
	}
	for _, c := range cases {
		if p, r := v.resolve(c.name, c.global); p != c.policy || r != c.rule {
			t.Errorf("resolve(%q, %q) = %q, %q; want %q, %q", c.name, c.global, p, r, c.policy, c.rule)
		}
	}
}

func TestPlanFlagPlacesGroupsOnWorkers(t *testing.T) {
	v := planFlag{}
	if err := v.Set("halves=s0/u0:0, s0/u1:0, s1/u0:1,s1/u1: 1"); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"nolabel", "=s0/u0:0", "x=", "x=s0/u0", "x=s0/u0:a", "x=s0/u0:-1", "x=:1"} {
		if err := v.Set(bad); err == nil {
			t.Errorf("Set(%q) accepted", bad)
		}
	}
	if err := v.check(2); err != nil {
		t.Fatal(err)
	}
	if err := v.check(1); err == nil {
		t.Error("a plan on worker 1 of 1 accepted")
	}
	p := v["halves"]
	sessions, err := workload.Generate(workload.Spec{Kind: "shared-prefix", Systems: 2, Users: 2, Questions: 2})
	if err != nil {
		t.Fatal(err)
	}
	if err := p.covers(sessions); err != nil {
		t.Fatal(err)
	}
	sessions, _ = workload.Generate(workload.Spec{Kind: "shared-prefix", Systems: 2, Users: 3, Questions: 2})
	if err := p.covers(sessions); err == nil || !strings.Contains(err.Error(), `"s0/u2"`) {
		t.Errorf("a plan missing s0/u2, s1/u2: %v", err)
	}
	got := p.addresses([]string{"a:1", "b:2"})
	want := map[string]string{"s0/u0": "a:1", "s0/u1": "a:1", "s1/u0": "b:2", "s1/u1": "b:2"}
	if !maps.Equal(got, want) {
		t.Errorf("addresses = %v, want %v", got, want)
	}
	if plan(nil).addresses([]string{"a:1"}) != nil {
		t.Error("no plan gave addresses")
	}
}

// --seeds and --ladder refuse what would make a meaningless run.
func TestSeedsAndLadderFlags(t *testing.T) {
	if s, err := parseSeeds("", 3); err != nil || len(s) != 1 || s[0] != 3 {
		t.Fatalf("no --seeds: %v %v", s, err)
	}
	if s, err := parseSeeds("4, 5,6", 1); err != nil || len(s) != 3 || s[2] != 6 {
		t.Fatalf("--seeds 4,5,6: %v %v", s, err)
	}
	for _, bad := range []string{"4,4", "x", "0"} {
		if _, err := parseSeeds(bad, 1); err == nil {
			t.Errorf("--seeds %q accepted", bad)
		}
	}
	if r, err := parseRates("1, 2.5,8"); err != nil || len(r) != 3 || r[1] != 2.5 {
		t.Fatalf("--ladder: %v %v", r, err)
	}
	for _, bad := range []string{"", "2,2", "4,2", "-1", "inf"} {
		if _, err := parseRates(bad); err == nil {
			t.Errorf("--ladder %q accepted", bad)
		}
	}
}

// The policies of a round run one after the other; every other round runs
// them the other way round, so neither is always first.
func TestRoundsAlternateThePoliciesOrder(t *testing.T) {
	pols := []string{"cache_aware", "epp", "least_request"}
	if got := roundOrder(pols, 0); !slices.Equal(got, pols) {
		t.Fatalf("round 0: %v", got)
	}
	if got := roundOrder(pols, 1); !slices.Equal(got, []string{"least_request", "epp", "cache_aware"}) {
		t.Fatalf("round 1: %v", got)
	}
	if !slices.Equal(pols, []string{"cache_aware", "epp", "least_request"}) || !slices.Equal(roundOrder(pols, 2), pols) {
		t.Fatalf("the given order changed: %v", pols)
	}
}
