package main

import "testing"

func TestVariantFlagResolvesLabelsToAPolicyAndItsRuleKeys(t *testing.T) {
	v := variantFlag{}
	if err := v.Set("ca-w1=cache_aware; herd_wait: 1, herd_share: 3"); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []string{"nolabel", "=cache_aware", "x=", "x= ; herd_wait: 1"} {
		if err := v.Set(bad); err == nil {
			t.Errorf("Set(%q) accepted", bad)
		}
	}
	cases := []struct{ name, global, policy, rule string }{
		{"ca-w1", "", "cache_aware", "herd_wait: 1, herd_share: 3"},
		{"ca-w1", "candidate_percent: 20", "cache_aware", "candidate_percent: 20, herd_wait: 1, herd_share: 3"},
		{"epp", "candidate_percent: 20", "epp", "candidate_percent: 20"},
	}
	for _, c := range cases {
		if p, r := v.resolve(c.name, c.global); p != c.policy || r != c.rule {
			t.Errorf("resolve(%q, %q) = %q, %q; want %q, %q", c.name, c.global, p, r, c.policy, c.rule)
		}
	}
}
