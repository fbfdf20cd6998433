package chaos

import (
	"context"
	"errors"
	"math"
	"strings"
	"sync"
	"testing"
	"time"
)

func rec(id int, start, end float64, o Outcome, ttftMS float64) Record {
	return Record{ID: id, Start: secs(start), End: secs(end), Outcome: o, TTFT: time.Duration(ttftMS * float64(time.Millisecond)), Status: 200}
}

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

func TestRecoveryNeedsThreeGoodBucketsInARow(t *testing.T) {
	base := Baseline{SuccessRate: 1, TTFTP50: 100, TTFTP90: 150}
	var rs []Record
	add := func(start float64, o Outcome, ttft float64) { rs = append(rs, rec(len(rs), start, start+0.1, o, ttft)) }
	// Fault ends at 10 s. 10–11: failures; 11–12: fine; 12–13: slow (TTFT
	// past max(2×p50, p90)); 13–14 empty (no evidence); 14–17 fine.
	add(10.2, Failed, 0)
	add(10.5, OK, 90)
	add(11.3, OK, 100)
	add(12.4, OK, 900)
	for _, s := range []float64{14.1, 14.6, 15.2, 16.3} {
		add(s, OK, 110)
	}
	add(9.9, Failed, 0) // before the end: not looked at
	d, ok := Recovery(rs, secs(10), secs(20), base, time.Second)
	if !ok || d != 4*time.Second {
		t.Fatalf("recovery = %v, %v; want 4s (bucket 14–15 starts the first good run of three)", d, ok)
	}
	if _, ok := Recovery(rs, secs(10), secs(16), base, time.Second); ok {
		t.Fatal("recovered with only two good buckets before the window closed")
	}
	// A fleet that never returns to the baseline's success rate.
	var bad []Record
	for i := range 20 {
		o := OK
		if i%4 == 0 {
			o = Failed
		}
		bad = append(bad, rec(i, 10+float64(i)/2, 10.2+float64(i)/2, o, 100))
	}
	if d, ok := Recovery(bad, secs(10), secs(20), base, time.Second); ok {
		t.Fatalf("a 25%% failure rate recovered after %v", d)
	}
}

func TestAnalyzeAssignsRequestsToTheFaultThatHitThem(t *testing.T) {
	ws := []Window{
		{Name: "kill", Start: secs(10), End: secs(13), Next: secs(30),
			expected: func(r Record) bool { return r.Worker == "w0" && inFlightAt(r, secs(10)) }},
		{Name: "burst", Start: secs(30), End: secs(31), Next: secs(40)},
	}
	rs := []Record{
		rec(0, 2, 3, OK, 100),      // baseline
		rec(1, 9, 10.5, Reset, 50), // in flight at the kill: expected
		rec(2, 11, 11.5, Failed, 0),
		rec(3, 12, 14, OK, 300),
		rec(4, 12.5, 31, OK, 200), // started while the kill was on, hung into the burst's window
		rec(8, 31, 32, OK, 100),
		rec(5, 32, 33, Aborted, 20),
		rec(6, 33, 34, Cut, 20),
		rec(7, 35, 36, Unanswered, 0),
		// Started in the kill's window after its recovery, in flight when
		// the burst came: the burst's (it had failed before this rule).
		rec(9, 29.5, 30.5, Reset, 0),
	}
	rs[1].Worker, rs[1].Status = "w0", 200
	rs[2].Status, rs[2].Retries = 503, []string{"connect"}
	checks := []Check{{IndexEntries: 10, IndexTrue: 9, Precision: 0.9}}
	out := Analyze(rs, ws, checks, Baseline{SuccessRate: 1, TTFTP50: 100, TTFTP90: 200}, time.Second)
	k, b := out[0], out[1]
	if k.Failed["stream-reset"] != 1 || k.Failed["503"] != 1 || k.Expected != 1 || k.Unexpected != 1 || k.Retried != 1 || k.Retries["connect"] != 1 {
		t.Fatalf("kill window: %+v", k)
	}
	if k.Check.IndexTrue != 9 || b.Check.IndexEntries != 0 {
		t.Fatalf("checks not matched to their windows: %+v / %+v", k.Check, b.Check)
	}
	if k.Sent != 4 || k.Succeeded != 2 {
		t.Fatalf("kill window with the hung request: %+v", k)
	}
	if b.Sent != 5 || b.Succeeded != 1 || b.Aborted != 1 || b.Lost != 2 || b.Unexpected != 3 || b.Failed["stream-reset"] != 1 {
		t.Fatalf("burst window: %+v", b)
	}
	if rs[0].Fault != "" || rs[1].Fault != "kill" || rs[4].Fault != "kill" || rs[8].Fault != "burst" || rs[9].Fault != "burst" {
		t.Fatalf("faults assigned: %q %q %q %q %q", rs[0].Fault, rs[1].Fault, rs[4].Fault, rs[8].Fault, rs[9].Fault)
	}
	// Ran entirely before the first fault: 0 (ok), not 1 (broken off by
	// the kill, the kill's).
	if base := BaselineOf(rs, 0, secs(10)); base.Requests != 1 || base.SuccessRate != 1 || base.TTFTP50 != 100 {
		t.Fatalf("baseline %+v", base)
	}
}

func TestFitFlagsALeakNotNoiseOrWarmUp(t *testing.T) {
	var ss []Sample
	for i := range 360 { // 30 min at 5 s
		t := float64(i * 5)
		// Warm-up then flat with noise: stays.
		warm := 40 + math.Min(t, 300)/10 + float64(i%7)
		ss = append(ss, Sample{t, "gateway goroutines", warm})
		// One goroutine leaked every 10 s: 90 over the second half.
		ss = append(ss, Sample{t, "worker-0 goroutines", 30 + t/10})
		// The heap breathing by ±8 MiB.
		ss = append(ss, Sample{t, "metadata-center rss_mb", 30 + 8*math.Sin(t/60)})
		ss = append(ss, Sample{t, SeriesLeases, float64(i % 6)})
	}
	got := map[string]Growth{}
	for _, g := range Fit(ss) {
		got[g.Series] = g
	}
	for name, want := range map[string]bool{"gateway goroutines": false, "worker-0 goroutines": true, "metadata-center rss_mb": false, SeriesLeases: false} {
		if g := got[name]; g.Grows != want {
			t.Errorf("%s: %+v, want grows=%v", name, g, want)
		}
	}
	if g := got["worker-0 goroutines"]; math.Abs(g.Slope-360) > 1 || math.Abs(g.Rise-89.5) > 1 {
		t.Errorf("leak fitted as %+v, want 360/h, ~90 over the second half", g)
	}
}

func TestGaugeFromTheTextExposition(t *testing.T) {
	text := "# HELP go_goroutines n\n# TYPE go_goroutines gauge\ngo_goroutines_total_x 3\ngo_goroutines 17\nprocess_open_fds 9\n"
	if v, err := gaugeFrom(strings.NewReader(text), "go_goroutines"); err != nil || v != 17 {
		t.Fatalf("go_goroutines = %v, %v", v, err)
	}
	if _, err := gaugeFrom(strings.NewReader(text), "nope"); err == nil {
		t.Fatal("a missing metric was found")
	}
}

type obsRecorder struct {
	mu   sync.Mutex
	seen []string
}

func (o *obsRecorder) Recovered(_ context.Context, w *Window) {
	o.mu.Lock()
	o.seen = append(o.seen, "recovered "+w.Name)
	o.mu.Unlock()
}
func (o *obsRecorder) WindowDone(_ context.Context, w *Window) {
	o.mu.Lock()
	o.seen = append(o.seen, "done "+w.Name)
	o.mu.Unlock()
}

func TestScheduleRunsFaultsInOrderAndAlwaysRecovers(t *testing.T) {
	var mu sync.Mutex
	var log []string
	note := func(s string) func(context.Context) error {
		return func(context.Context) error { mu.Lock(); log = append(log, s); mu.Unlock(); return nil }
	}
	s := Schedule{Baseline: 20 * time.Millisecond, Settle: 10 * time.Millisecond, Gap: 30 * time.Millisecond,
		Before: func(context.Context) { note("before")(nil) },
		Faults: []Fault{
			{Name: "a", Hold: 20 * time.Millisecond, Inject: note("inject a"), Recover: note("recover a")},
			{Name: "b", Inject: func(context.Context) error { return errors.New("boom") }, Recover: note("recover b"),
				Restarts: func() []Restart { return []Restart{{Worker: "w0", OldPID: 1, NewPID: 2}} }},
		}}
	obs := &obsRecorder{}
	start := time.Now()
	ws := s.Run(context.Background(), start, obs)
	if strings.Join(log, ",") != "before,inject a,recover a,recover b" {
		t.Fatalf("order %v", log)
	}
	if strings.Join(obs.seen, ",") != "recovered a,done a,recovered b,done b" {
		t.Fatalf("observer saw %v", obs.seen)
	}
	if len(ws) != 2 || ws[0].Start < 20*time.Millisecond || ws[0].End-ws[0].Start < 20*time.Millisecond ||
		ws[0].Next-ws[0].End < 30*time.Millisecond || ws[1].Start < ws[0].Next || !strings.Contains(ws[1].Err, "boom") || ws[0].Err != "" {
		t.Fatalf("windows %+v", ws)
	}
	if len(ws[0].Restarts) != 0 || len(ws[1].Restarts) != 1 || ws[1].Restarts[0].NewPID != 2 {
		t.Fatalf("restarts %+v, %+v", ws[0].Restarts, ws[1].Restarts)
	}
	if fs := Analyze(nil, ws, nil, Baseline{}, time.Second); len(fs[1].Restarts) != 1 || fs[1].Restarts[0].Worker != "w0" {
		t.Fatalf("fault stats %+v", fs[1])
	}
}

// A request belongs to the window it started in while that fault was on,
// but a later fault may be what ended it: its failure is expected when
// any fault's own rule says so (here a stream started during an outage of
// the metadata center, still running on the gateway a later kill took).
func TestAFailureALaterFaultCausedIsExpected(t *testing.T) {
	ws := []Window{
		{Name: "mc-restart", Start: secs(10), End: secs(12), Next: secs(20)},
		{Name: "gateway-kill", Start: secs(20), End: secs(23), Next: secs(40),
			expected: func(r Record) bool { return r.Gateway == "g1" && inFlightAt(r, secs(20)) }},
	}
	rs := []Record{rec(0, 11, 20.5, Reset, 0), rec(1, 11, 20.5, Reset, 0)}
	rs[0].Gateway, rs[1].Gateway = "g1", "g0"
	out := Analyze(rs, ws, nil, Baseline{SuccessRate: 1, TTFTP50: 100, TTFTP90: 200}, time.Second)
	if m := out[0]; m.Sent != 2 || m.Expected != 1 || m.Unexpected != 1 {
		t.Fatalf("mc-restart window: %+v, want the killed gateway's stream expected, the other not", m)
	}
}
