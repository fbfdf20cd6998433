package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	workerserver "github.com/istio-llm-filter/istio-llm-filter/worker/server"
)

// Checker reads the metadata center's index and leases and the workers'
// own views over HTTP.
type Checker struct {
	MC      string   // metadata center base URL
	Cluster string   // the workers' cluster
	Workers []string // ip:port
	HTTP    *http.Client
	// Dump, if set, is a file that receives the index, the workers' views
	// and the wrong entries of each check (the last check's win).
	Dump string
}

func (c Checker) get(ctx context.Context, u string, out any) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return err
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 64<<20))
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %d %.200s", u, resp.StatusCode, body)
	}
	return json.Unmarshal(body, out)
}

// Index is the center's index of the cluster: host -> prefix hashes.
func (c Checker) Index(ctx context.Context) (map[string][]string, error) {
	var idx map[string][]string
	err := c.get(ctx, c.MC+api.PathDebugCacheIndex+"?cluster="+url.QueryEscape(c.Cluster), &idx)
	return idx, err
}

// Held is every worker's own view: host -> prefix hash -> Holds (its KV
// cache holds it) or Pending (only a request it accepted and has not
// answered yet carries it). A worker that does not answer is absent: it
// holds nothing (it is down or restarting: an index entry naming it is
// wrong).
func (c Checker) Held(ctx context.Context) map[string]map[string]Holding {
	out := map[string]map[string]Holding{}
	for _, w := range c.Workers {
		var kv workerserver.KVPrefixes
		if err := c.get(ctx, "http://"+w+workerserver.PathDebugKVPrefixes, &kv); err != nil {
			continue
		}
		set := map[string]Holding{}
		for _, h := range kv.Pending {
			set[h] = Pending
		}
		for _, h := range kv.Prefixes {
			set[h] = Holds
		}
		out[w] = set
	}
	return out
}

// Leases is the number of live leases the center counts for the cluster.
func (c Checker) Leases(ctx context.Context) (int, error) {
	var load api.LoadStats
	if err := c.get(ctx, c.MC+api.PathLoadStats+"?cluster="+url.QueryEscape(c.Cluster), &load); err != nil {
		return 0, err
	}
	n := 0
	for _, e := range load {
		n += int(e.TotalReqs)
	}
	return n, nil
}

// Check takes the index, the workers' views and the leases at one moment,
// with inFlight the client's requests outstanding at that moment. The
// index is one read, the workers' views several (one per worker, each
// waiting for its scheduler loop, tens of milliseconds apart), so the
// workers are read twice, right before the index and right after, and an
// entry counts as held when either read holds it: a prefix a worker
// dropped while the check was reading (its eviction report could not have
// reached the index yet) is not the index's error, and one it gained in
// between was saved for a request routed there. Entries held only in the
// read before are counted (IndexInTransit) and listed in the dump, but
// only for a worker that answered the read after too: one that stopped
// answering holds nothing. An entry neither read holds is wrong.
func (c Checker) Check(ctx context.Context, inFlight func() int) Check {
	var ch Check
	var errs []string
	before := c.Held(ctx)
	at := time.Now()
	idx, err := c.Index(ctx)
	if err != nil {
		errs = append(errs, "index: "+err.Error())
	}
	after := c.Held(ctx)
	held := map[string]map[string]Holding{}
	transit := map[string][]string{}
	for host, hs := range idx {
		if _, answered := after[host]; !answered {
			continue // gone since the read before: what it held is not in transit
		}
		for _, h := range hs {
			if after[host][h] == 0 && before[host][h] != 0 {
				transit[host] = append(transit[host], h)
				ch.IndexInTransit++
			}
		}
	}
	for host, set := range after {
		m := make(map[string]Holding, len(set)+len(transit[host]))
		for h, v := range set {
			m[h] = v
		}
		for _, h := range transit[host] {
			m[h] = before[host][h]
		}
		held[host] = m
	}
	ch.IndexEntries, ch.IndexTrue, ch.IndexPending, ch.FalseByHost = Precision(idx, held)
	if c.Dump != "" {
		wrong := map[string][]string{}
		for host, hs := range idx {
			for _, h := range hs {
				if held[host][h] == 0 {
					wrong[host] = append(wrong[host], h)
				}
			}
		}
		if err := writeJSON(c.Dump, map[string]any{"at": at.UTC().Format(time.RFC3339Nano), "index": idx, "held": after,
			"held_before": before, "in_transit": transit, "wrong": wrong}); err != nil {
			errs = append(errs, "dump: "+err.Error())
		}
	}
	ch.Precision, ch.StrictPrecision = -1, -1
	if ch.IndexEntries > 0 {
		ch.Precision = float64(ch.IndexTrue+ch.IndexPending) / float64(ch.IndexEntries)
		ch.StrictPrecision = float64(ch.IndexTrue) / float64(ch.IndexEntries)
	}
	ch.InFlight = inFlight()
	if ch.Leases, err = c.Leases(ctx); err != nil {
		errs = append(errs, "leases: "+err.Error())
	}
	ch.Err = strings.Join(errs, "; ")
	return ch
}
