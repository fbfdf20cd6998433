package endpoints

import (
	"slices"
	"testing"
	"time"
)

func addrsOf(es []Endpoint) []string {
	var out []string
	for _, e := range es {
		out = append(out, e.Address)
	}
	return out
}

func TestOutlierEjectsBacksOffAndRestores(t *testing.T) {
	src, err := NewStatic(map[string][]string{"c": {"10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80"}})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1000, 0)
	o := NewOutlier(OutlierOptions{BaseEjection: 10 * time.Second, MaxEjection: 25 * time.Second, Now: func() time.Time { return now }})
	view := o.Wrap(src)

	o.Failed("10.0.0.2:80")
	if got := addrsOf(view.Endpoints("c")); len(got) != 2 || got[0] != "10.0.0.1:80" || got[1] != "10.0.0.3:80" {
		t.Fatalf("after one failure: %v", got)
	}
	o.Failed("10.0.0.2:80") // while ejected: the same event, no extra backoff
	now = now.Add(10 * time.Second)
	if o.Ejected("10.0.0.2:80") || len(view.Endpoints("c")) != 3 {
		t.Fatal("first ejection must last the base time only")
	}
	o.Failed("10.0.0.2:80") // second ejection: doubled to 20s
	now = now.Add(19 * time.Second)
	if !o.Ejected("10.0.0.2:80") {
		t.Fatal("second ejection must last twice the base time")
	}
	now = now.Add(time.Second)
	o.Failed("10.0.0.2:80") // third: 40s capped at 25s
	now = now.Add(24 * time.Second)
	if !o.Ejected("10.0.0.2:80") {
		t.Fatal("third ejection ended before the cap")
	}
	now = now.Add(time.Second)
	if o.Ejected("10.0.0.2:80") {
		t.Fatal("ejection exceeded MaxEjection")
	}
	o.Succeeded("10.0.0.2:80")
	o.Failed("10.0.0.2:80")
	now = now.Add(10 * time.Second)
	if o.Ejected("10.0.0.2:80") {
		t.Fatal("a success must reset the backoff to the base time")
	}
}

// A suspect is left out at once, for at most its time: Cleared takes it
// back without an ejection, Failed turns it into one.
func TestOutlierSuspect(t *testing.T) {
	src, err := NewStatic(map[string][]string{"c": {"10.0.0.1:80", "10.0.0.2:80"}})
	if err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1000, 0)
	o := NewOutlier(OutlierOptions{BaseEjection: 10 * time.Second, Now: func() time.Time { return now }})
	view := o.Wrap(src)
	left := func() []string { return addrsOf(view.Endpoints("c")) }

	o.Suspect("10.0.0.2:80", time.Second)
	if got := left(); !slices.Equal(got, []string{"10.0.0.1:80"}) {
		t.Fatalf("with a suspect: %v", got)
	}
	o.Cleared("10.0.0.2:80")
	if got := left(); len(got) != 2 || o.Ejected("10.0.0.2:80") {
		t.Fatalf("cleared: %v, ejected %v", got, o.Ejected("10.0.0.2:80"))
	}

	o.Suspect("10.0.0.2:80", time.Second)
	now = now.Add(time.Second)
	if got := left(); len(got) != 2 {
		t.Fatalf("a suspicion outlived its time: %v", got)
	}

	o.Suspect("10.0.0.2:80", time.Second)
	o.Failed("10.0.0.2:80")
	now = now.Add(2 * time.Second)
	if got := left(); !slices.Equal(got, []string{"10.0.0.1:80"}) || !o.Ejected("10.0.0.2:80") {
		t.Fatalf("a failed suspect must be ejected for the base time: %v", got)
	}
}

func TestOutlierPanicModeReturnsAllWhenAllEjected(t *testing.T) {
	src, _ := NewStatic(map[string][]string{"c": {"10.0.0.1:80", "10.0.0.2:80"}})
	o := NewOutlier(OutlierOptions{})
	view := o.Wrap(src)
	o.Failed("10.0.0.1:80")
	o.Failed("10.0.0.2:80")
	if got := view.Endpoints("c"); len(got) != 2 {
		t.Fatalf("all ejected must return all (panic mode), got %v", addrsOf(got))
	}
	if got := view.Endpoints("unknown"); len(got) != 0 {
		t.Fatalf("unknown cluster: %v", got)
	}
}

// Append gives what Endpoints gives, after what dst held, and copies into
// dst's room rather than allocating: the gateway reuses one buffer per
// decision (docs/benchmarks.md).
func TestAppendMatchesEndpointsWithoutAllocating(t *testing.T) {
	src, err := NewStatic(map[string][]string{"c": {"10.0.0.1:80", "10.0.0.2:80", "10.0.0.3:80", "10.0.0.4:80"}})
	if err != nil {
		t.Fatal(err)
	}
	o := NewOutlier(OutlierOptions{})
	view := o.Wrap(src)
	o.Failed("10.0.0.2:80")
	o.Failed("10.0.0.4:80")
	head := Endpoint{Address: "10.9.9.9:80"}
	for name, s := range map[string]Source{"static": src, "outlier": view} {
		got := Append([]Endpoint{head}, s, "c")
		if want := append([]string{head.Address}, addrsOf(s.Endpoints("c"))...); !slices.Equal(addrsOf(got), want) {
			t.Fatalf("%s: Append = %v, Endpoints after dst = %v", name, addrsOf(got), want)
		}
		buf := make([]Endpoint, 0, 8)
		if n := testing.AllocsPerRun(100, func() { buf = Append(buf[:0], s, "c") }); n != 0 {
			t.Fatalf("%s: Append allocated %v times with room in dst", name, n)
		}
	}
	if got := addrsOf(view.Endpoints("c")); !slices.Equal(got, []string{"10.0.0.1:80", "10.0.0.3:80"}) {
		t.Fatalf("outlier view = %v", got)
	}
}
