package main

import (
	"math"
	"reflect"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/worker/scheduler"
)

// The reported costs keep two significant digits, so that the fit's drift
// from one step to the next is not a change worth a report; nothing,
// infinities and NaN read as not reported.
func TestCostsGoOutToTwoDigits(t *testing.T) {
	for v, want := range map[float64]float64{5.8123e-4: 5.8e-4, 1.0999e-6: 1.1e-6, 0.01249: 0.012, 3.456: 3.5, 123.4: 120,
		0: 0, -1: 0, math.Inf(1): 0, math.NaN(): 0} {
		if got := twoDigits(v); math.Abs(got-want) > 1e-12*math.Abs(want) {
			t.Errorf("twoDigits(%g) = %g, want %g", v, got, want)
		}
	}
	got := prefillQueue([]scheduler.Prefill{{Tokens: 100, Seconds: 0.01234}, {Tokens: 900, Seconds: 0}, {Tokens: 3000, Seconds: 4.567}})
	if want := []api.Prefill{{Tokens: 100, Seconds: 0.012}, {Tokens: 3000, Seconds: 4.6}}; !reflect.DeepEqual(got, want) {
		t.Fatalf("prefillQueue = %+v, want %+v (a request priced at nothing is left out)", got, want)
	}
}
