package routing

import (
	"context"
	"slices"
	"strings"
)

// Adapter is a LoRA adapter some registered pod serves, for the gateway's
// model list: ID is the name requests give in "lora" (or "model"), Parent
// the configured model whose rules reach the pod.
type Adapter struct {
	ID, Parent string
}

// ListsAdapters reports whether Adapters can ask anyone (a metadata center
// is configured).
func (e *Decider) ListsAdapters() bool { return e.querier != nil }

// Adapters lists the adapters the pods registered in the rules' clusters
// serve, sorted by ID, each once, within the query timeout. The parent is
// the pod's registered model when a rule of that name reaches the cluster,
// else the first (by name) model whose rules reach it. A cluster whose
// registrations cannot be read is left out and its error returned with
// what the others gave.
func (e *Decider) Adapters(ctx context.Context) ([]Adapter, error) {
	if e.querier == nil {
		return nil, nil
	}
	ctx, cancel := context.WithTimeout(ctx, e.qto)
	defer cancel()
	models := map[string][]string{} // cluster -> models whose rules reach it, sorted
	for m, rs := range e.cfg.ModelMappingRule {
		for _, r := range rs {
			if !slices.Contains(models[r.Cluster], m) {
				models[r.Cluster] = append(models[r.Cluster], m)
			}
		}
	}
	clusters := make([]string, 0, len(models))
	for c := range models {
		slices.Sort(models[c])
		clusters = append(clusters, c)
	}
	slices.Sort(clusters)
	seen := map[string]bool{}
	var out []Adapter
	var firstErr error
	for _, c := range clusters {
		pods, err := e.querier.Pods(ctx, c)
		if err != nil {
			if firstErr == nil {
				firstErr = err
			}
			continue
		}
		for _, p := range pods {
			parent := models[c][0]
			if len(p.Models) > 0 && slices.Contains(models[c], p.Models[0]) {
				parent = p.Models[0]
			}
			for _, a := range p.Adapters {
				if seen[a] {
					continue
				}
				seen[a] = true
				out = append(out, Adapter{ID: a, Parent: parent})
			}
		}
	}
	slices.SortFunc(out, func(a, b Adapter) int { return strings.Compare(a.ID, b.ID) })
	return out, firstErr
}
