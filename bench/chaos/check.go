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

// Bounds of the index check (docs/operations.md, "Chaos and soak"): how
// long after a pod stopped holding a prefix, or refused the request that
// the router saved it for, the index may still name it.
const (
	// EvictionBound: from an eviction to its report applied. The
	// worker's reporter (worker/mcreport) sends at once, with no batching
	// interval and one report on the wire at a time, so an eviction waits
	// for at most the report before it and its own; a failed send is
	// retried after 100 ms, 200 ms, 400 ms, then every 500 ms, so once the
	// center answers again (a check comes a second after the recovery)
	// the backlog lands within half a second and a send; the center
	// applies a report to its store before it answers. An entry
	// whose report the center acknowledged before the index was read is
	// wrong however recent; one still unacknowledged after the bound is a
	// late report, wrong too.
	EvictionBound = time.Second
	// RetractionBound: from a pod's refusal to the gateway's retraction of
	// the routing-time save applied: the gateway withdraws it when it sees
	// the answer, in its next batch to the center (a 5 ms window).
	RetractionBound = time.Second
)

// View is one worker's answer to its /debug/kv/prefixes.
type View struct {
	Held    map[string]Holding           // Holds or Pending
	Evicted map[string]workerserver.Gone // the latest eviction of each hash
	Refused map[string]int64             // the latest refusal, Unix ms
	Since   int64                        // Evicted is complete after this (Unix ms)
}

// Views reads every worker's own view. A worker that does not answer is
// absent: it holds nothing (it is down or restarting: an index entry
// naming it is wrong).
func (c Checker) Views(ctx context.Context) map[string]*View {
	out := map[string]*View{}
	for _, w := range c.Workers {
		var kv workerserver.KVPrefixes
		if err := c.get(ctx, "http://"+w+workerserver.PathDebugKVPrefixes, &kv); err != nil {
			continue
		}
		v := &View{Held: map[string]Holding{}, Evicted: map[string]workerserver.Gone{}, Refused: map[string]int64{}, Since: kv.EvictedSince}
		for _, h := range kv.Pending {
			v.Held[h] = Pending
		}
		for _, h := range kv.Prefixes {
			v.Held[h] = Holds
		}
		for _, g := range kv.Evicted {
			v.Evicted[g.Hash] = g
		}
		for _, g := range kv.Refused {
			v.Refused[g.Hash] = max(v.Refused[g.Hash], g.At)
		}
		out[w] = v
	}
	return out
}

// Classify says what host's view v makes of an index entry for prefix h
// read at at: Holds (held now, or evicted after at: held when the index
// was read) or Pending (true); InTransit, the pod evicted it before at and
// the center had not acknowledged the report by then, within
// EvictionBound; Retracting, the pod refused a request carrying it
// within RetractionBound of the read; otherwise 0 (wrong), with why.
func Classify(v *View, h string, at time.Time) (Holding, string) {
	if v == nil {
		return 0, "the worker did not answer"
	}
	if k := v.Held[h]; k != 0 {
		return k, ""
	}
	ms := at.UnixMilli()
	if t, ok := v.Refused[h]; ok && ms-t <= RetractionBound.Milliseconds() {
		return Retracting, ""
	}
	e, ok := v.Evicted[h]
	switch {
	case ok && e.At >= ms:
		return Holds, "" // held when the index was read
	case ok && e.Reported != 0 && e.Reported < ms:
		return 0, fmt.Sprintf("evicted %d ms before the index read, its report acknowledged %d ms before it", ms-e.At, ms-e.Reported)
	case ok && ms-e.At <= EvictionBound.Milliseconds():
		return InTransit, ""
	case ok:
		return 0, fmt.Sprintf("evicted %d ms before the index read, its report late", ms-e.At)
	case ms-EvictionBound.Milliseconds() < v.Since:
		return 0, fmt.Sprintf("not held, not evicted since %d ms before the index read; earlier evictions not listed", ms-v.Since)
	}
	return 0, "not held, not evicted or refused lately"
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
// workers are read right after the index; each lists what it holds, what
// its accepted requests carry, and what it evicted or refused lately with
// when (worker/server's /debug/kv/prefixes), so every index entry is
// classified against the moment the index was read (Classify).
func (c Checker) Check(ctx context.Context, inFlight func() int) Check {
	var ch Check
	var errs []string
	at := time.Now()
	idx, err := c.Index(ctx)
	if err != nil {
		errs = append(errs, "index: "+err.Error())
	}
	views := c.Views(ctx)
	wrong := map[string]map[string]string{}
	ch.FalseByHost = map[string]int{}
	for host, hs := range idx {
		for _, h := range hs {
			ch.IndexEntries++
			k, why := Classify(views[host], h, at)
			switch k {
			case Holds:
				ch.IndexTrue++
			case Pending:
				ch.IndexPending++
			case InTransit:
				ch.IndexInTransit++
			case Retracting:
				ch.IndexRetracting++
			default:
				ch.FalseByHost[host]++
				if wrong[host] == nil {
					wrong[host] = map[string]string{}
				}
				wrong[host][h] = why
			}
		}
	}
	for _, v := range views {
		for _, e := range v.Evicted {
			if e.Reported != 0 {
				ch.ReportLatencyMax = max(ch.ReportLatencyMax, float64(e.Reported-e.At))
			}
		}
	}
	if c.Dump != "" {
		if err := writeJSON(c.Dump, map[string]any{"at": at.UTC().Format(time.RFC3339Nano), "index": idx, "views": views, "wrong": wrong}); err != nil {
			errs = append(errs, "dump: "+err.Error())
		}
	}
	ch.Precision, ch.StrictPrecision = -1, -1
	if ch.IndexEntries > 0 {
		ch.Precision = float64(ch.IndexEntries-ch.Wrong()) / float64(ch.IndexEntries)
		ch.StrictPrecision = float64(ch.IndexTrue) / float64(ch.IndexEntries)
	}
	ch.InFlight = inFlight()
	if ch.Leases, err = c.Leases(ctx); err != nil {
		errs = append(errs, "leases: "+err.Error())
	}
	ch.Err = strings.Join(errs, "; ")
	return ch
}
