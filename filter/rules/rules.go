// Package rules maps a request to its routing rule (docs/configuration.md):
// model name first, then header conditions, most conditions first, the first
// rule whose conditions all hold wins, and a rule without conditions is the
// model's default.
package rules

import (
	"sort"
	"strings"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
)

// Headers reads request headers; Envoy's api.RequestHeaderMap satisfies it.
type Headers interface {
	Get(key string) (string, bool)
}

// Table is the compiled model_mapping_rule. It is immutable and safe for
// concurrent use.
type Table struct {
	models map[string][]rule
}

type rule struct {
	cond []condition
	cfg  *config.Rule
}

type condition struct{ name, value string }

// New compiles the rules. Config validation has already refused duplicates,
// so the order among rules with equally many conditions is the configured one.
func New(m map[string][]config.Rule) *Table {
	t := &Table{models: make(map[string][]rule, len(m))}
	for model, list := range m {
		rs := make([]rule, len(list))
		for i := range list {
			r := rule{cfg: &list[i]}
			for name, v := range list[i].Headers {
				r.cond = append(r.cond, condition{strings.ToLower(name), v})
			}
			sort.Slice(r.cond, func(a, b int) bool { return r.cond[a].name < r.cond[b].name })
			rs[i] = r
		}
		sort.SliceStable(rs, func(a, b int) bool { return len(rs[a].cond) > len(rs[b].cond) })
		t.models[model] = rs
	}
	return t
}

// Result of a lookup.
type Result int

const (
	Matched       Result = iota
	UnknownModel         // no rules for the model: 404 "model not found"
	NoRuleMatched        // rules exist but none holds and there is no default
)

// Match returns the rule for a model and its request headers.
func (t *Table) Match(model string, h Headers) (*config.Rule, Result) {
	rs, ok := t.models[model]
	if !ok {
		return nil, UnknownModel
	}
next:
	for i := range rs {
		for _, c := range rs[i].cond {
			if v, ok := h.Get(c.name); !ok || v != c.value {
				continue next
			}
		}
		return rs[i].cfg, Matched
	}
	return nil, NoRuleMatched
}

// Models lists the configured model names, sorted.
func (t *Table) Models() []string {
	out := make([]string, 0, len(t.models))
	for m := range t.models {
		out = append(out, m)
	}
	sort.Strings(out)
	return out
}
