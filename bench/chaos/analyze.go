package chaos

import (
	"math"
	"slices"
	"sort"
	"strconv"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/report"
)

// Baseline is the fleet's behaviour under the load before any fault.
type Baseline struct {
	Requests    int     `json:"requests"`
	SuccessRate float64 `json:"success_rate"`
	TTFTP50     float64 `json:"ttft_p50_ms"`
	TTFTP90     float64 `json:"ttft_p90_ms"`
}

// Check is what the observer found one Settle after a fault's recovery.
type Check struct {
	// Index precision: entries of the metadata center's index that are
	// not wrong (Classify), over all entries: their host holds the prefix
	// (IndexTrue, its /debug/kv/prefixes), or is about to (IndexPending: a
	// request it accepted carries it, the router saved it when it routed
	// that request there), or dropped it so recently that the index
	// cannot know yet (IndexInTransit: evicted, its report not applied
	// within EvictionBound; IndexRetracting: the pod refused the request
	// within RetractionBound). StrictPrecision counts only the prefixes
	// held. Both -1 when the index is empty.
	IndexEntries    int     `json:"index_entries"`
	IndexTrue       int     `json:"index_true"`
	IndexPending    int     `json:"index_pending"`
	IndexInTransit  int     `json:"index_in_transit"`
	IndexRetracting int     `json:"index_retracting"`
	Precision       float64 `json:"precision"`
	StrictPrecision float64 `json:"strict_precision"`
	// ReportLatencyMax is the longest time, in ms, from an eviction to the
	// center's acknowledgement of its report among the evictions the
	// workers listed (the last ten seconds or so).
	ReportLatencyMax float64 `json:"report_latency_max_ms"`
	// FalseByHost counts the wrong entries per host they name.
	FalseByHost map[string]int `json:"false_by_host,omitempty"`
	// Leases the center counts beyond the requests the client has in
	// flight: leases nobody will delete (they go at the lease TTL).
	Leases   int    `json:"leases"`
	InFlight int    `json:"in_flight"`
	Err      string `json:"error,omitempty"`
}

// Wrong counts the index entries Classify finds wrong.
func (c Check) Wrong() int {
	return c.IndexEntries - c.IndexTrue - c.IndexPending - c.IndexInTransit - c.IndexRetracting
}

// Orphaned is Leases beyond InFlight (never negative).
func (c Check) Orphaned() int { return max(0, c.Leases-c.InFlight) }

// FaultStats is one row of the report.
type FaultStats struct {
	Name  string  `json:"name"`
	What  string  `json:"what"`
	Start float64 `json:"start_s"`
	End   float64 `json:"end_s"`
	Err   string  `json:"error,omitempty"`
	// Restarts are the workers the fault restarted (Window.Restarts).
	Restarts []Restart `json:"restarts,omitempty"`

	Sent      int            `json:"sent"`
	Succeeded int            `json:"succeeded"`
	Failed    map[string]int `json:"failed"` // by status; "stream-error" (an error event), "stream-reset" (broken off)
	Aborted   int            `json:"aborted_by_client"`
	Lost      int            `json:"lost"` // cut streams + unanswered
	// Expected are failed or lost requests the fault itself made
	// unanswerable; Unexpected all the others.
	Expected   int            `json:"expected_failures"`
	Unexpected int            `json:"unexpected_failures"`
	Retried    int            `json:"retried"` // requests the client sent more than once
	Retries    map[string]int `json:"retries"` // by reason

	TTFTP50 float64 `json:"ttft_p50_ms"`
	TTFTP90 float64 `json:"ttft_p90_ms"`

	Check     Check   `json:"check"`
	RecoveryS float64 `json:"recovery_s"` // -1: not back to baseline within the window
}

// Baseline of the records that ran entirely within [from, to), before the
// first fault: one still running when the fault began belongs to that
// fault's window (windowOf), whatever the fault did to it, and a hang
// shows there.
func BaselineOf(rs []Record, from, to time.Duration) Baseline {
	var b Baseline
	var ttft []float64
	ok := 0
	for _, r := range rs {
		if r.Start < from || r.End > to || r.Outcome == Aborted {
			continue
		}
		b.Requests++
		if r.Outcome == OK {
			ok++
			ttft = append(ttft, ms(r.TTFT))
		}
	}
	if b.Requests > 0 {
		b.SuccessRate = float64(ok) / float64(b.Requests)
	}
	sort.Float64s(ttft)
	b.TTFTP50, b.TTFTP90 = quantile(ttft, 0.5), quantile(ttft, 0.9)
	return b
}

// Analyze assigns each record to a window (windowOf, Record.Fault) and
// summarises every window.
func Analyze(rs []Record, ws []Window, checks []Check, base Baseline, bucket time.Duration) []FaultStats {
	out := make([]FaultStats, len(ws))
	for i, w := range ws {
		s := FaultStats{Name: w.Name, What: w.What, Start: w.Start.Seconds(), End: w.End.Seconds(), Err: w.Err, Restarts: w.Restarts,
			Failed: map[string]int{}, Retries: map[string]int{}}
		if i < len(checks) {
			s.Check = checks[i]
		}
		var ttft []float64
		var in []Record
		for j := range rs {
			r := &rs[j]
			if windowOf(*r, ws) != i {
				continue
			}
			r.Fault = w.Name
			in = append(in, *r)
			s.Sent++
			if len(r.Retries) > 0 {
				s.Retried++
				for _, why := range r.Retries {
					s.Retries[why]++
				}
			}
			switch {
			case r.Outcome == OK:
				s.Succeeded++
				ttft = append(ttft, ms(r.TTFT))
				continue
			case r.Outcome == Aborted:
				s.Aborted++
				continue
			case r.Outcome.Lost():
				s.Lost++
			default:
				s.Failed[failKey(*r)]++
			}
			if expectedByAny(ws, *r) {
				s.Expected++
			} else {
				s.Unexpected++
			}
		}
		sort.Float64s(ttft)
		s.TTFTP50, s.TTFTP90 = quantile(ttft, 0.5), quantile(ttft, 0.9)
		s.RecoveryS = -1
		if d, ok := Recovery(in, w.End, w.Next, base, bucket); ok {
			s.RecoveryS = d.Seconds()
		}
		out[i] = s
	}
	return out
}

// expectedByAny says whether some fault made r's failure unavoidable. A
// request belongs to one window (windowOf), but a later fault may be what
// ended it: a stream that started during a metadata-center restart and
// was still running on the gateway a later fault killed is that kill's.
func expectedByAny(ws []Window, r Record) bool {
	for _, w := range ws {
		if w.expected != nil && w.expected(r) {
			return true
		}
	}
	return false
}

// windowOf is the index of r's window, or -1 for the baseline. A request
// in flight when a fault was injected is that fault's (the first such
// fault), unless it started while an earlier fault was still on (between
// that fault's injection and its recovery): that one may have made it
// hang, and keeps it. Otherwise a request is the window's it started in.
// Under steady load every injection hits requests that started in the
// previous window's quiet tail (the gap after its recovery): they are the
// new fault's victims, not the previous fault's.
func windowOf(r Record, ws []Window) int {
	started := -1
	for i, w := range ws {
		if w.Start <= r.Start && r.Start < w.Next {
			started = i
			break
		}
	}
	if started >= 0 && r.Start <= ws[started].End {
		return started
	}
	for i, w := range ws {
		if r.Start < w.Start && w.Start <= r.End {
			return i
		}
	}
	return started
}

func failKey(r Record) string {
	if r.Outcome == Reset {
		return "stream-reset"
	}
	if r.Status/100 == 2 {
		return "stream-error"
	}
	return strconv.Itoa(r.Status)
}

// Recovery is how long after a fault ended (end) the fleet was back to its
// baseline: the start of the first bucket from which three non-empty
// buckets in a row each have a success rate no more than 2 points under
// the baseline's and a median TTFT within max(2 × baseline p50, baseline
// p90). Requests are bucketed by start time; client-aborted ones do not
// count. false: not back before next.
func Recovery(rs []Record, end, next time.Duration, base Baseline, bucket time.Duration) (time.Duration, bool) {
	if bucket <= 0 {
		bucket = time.Second
	}
	n := int((next - end + bucket - 1) / bucket)
	if n <= 0 {
		return 0, false
	}
	type acc struct {
		sent, ok int
		ttft     []float64
	}
	bs := make([]acc, n)
	for _, r := range rs {
		if r.Start < end || r.Start >= next || r.Outcome == Aborted {
			continue
		}
		b := &bs[int((r.Start-end)/bucket)]
		b.sent++
		if r.Outcome == OK {
			b.ok++
			b.ttft = append(b.ttft, ms(r.TTFT))
		}
	}
	good := func(b acc) bool {
		if float64(b.ok)/float64(b.sent) < base.SuccessRate-0.02 {
			return false
		}
		if len(b.ttft) == 0 {
			return false
		}
		slices.Sort(b.ttft)
		return quantile(b.ttft, 0.5) <= math.Max(2*base.TTFTP50, base.TTFTP90)
	}
	const need = 3
	run, first := 0, -1
	for i, b := range bs {
		if b.sent == 0 {
			continue // no evidence either way
		}
		if !good(b) {
			run, first = 0, -1
			continue
		}
		if run == 0 {
			first = i
		}
		if run++; run == need {
			return time.Duration(first) * bucket, true
		}
	}
	return 0, false
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

func quantile(sorted []float64, q float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	return report.Quantile(sorted, q)
}

// Holding is what a worker says about one prefix.
type Holding int

const (
	// Holds: a KV-cache entry of the worker holds the prefix.
	Holds Holding = iota + 1
	// Pending: only a request the worker accepted and has not answered
	// carries it.
	Pending
	// InTransit: the worker evicted it, and its report cannot have
	// reached the index yet.
	InTransit
	// Retracting: the worker refused a request carrying it, and the
	// gateway's retraction of its routing-time save cannot have reached
	// the index yet.
	Retracting
)
