package api

import (
	"reflect"
	"testing"
)

// Every field of a pod's signals survives the trip into a report and back
// (AgeMS aside: it is stamped by the metadata center, never reported), so
// a field added to PodSignals and PodReport but not to their conversions
// is caught here rather than dropped on the way to the gateways.
func TestPodSignalsSurviveTheirReport(t *testing.T) {
	var sig PodSignals
	v := reflect.ValueOf(&sig).Elem()
	for i := range v.NumField() {
		if v.Type().Field(i).Name == "AgeMS" {
			continue
		}
		switch f := v.Field(i); f.Kind() {
		case reflect.Int64:
			f.SetInt(int64(i + 1))
		case reflect.Float64:
			f.SetFloat(float64(i) + 0.5)
		case reflect.Bool:
			f.SetBool(true)
		case reflect.Slice: // PrefillQueue
			f.Set(reflect.ValueOf([]Prefill{{Tokens: int64(i), Seconds: 0.5}}))
		default:
			t.Fatalf("field %s of kind %s: teach this test to fill it", v.Type().Field(i).Name, f.Kind())
		}
	}
	reg := &PodRegistration{Models: []string{"m"}}
	rep := sig.Report("c", "10.0.0.1:80", reg)
	if rep.Cluster != "c" || rep.Host != "10.0.0.1:80" || rep.Register != reg {
		t.Fatalf("report %+v lost its cluster, host or registration", rep)
	}
	if got := rep.Signals(); !reflect.DeepEqual(got, sig) {
		t.Fatalf("signals after a report: %+v, want %+v", got, sig)
	}
}
