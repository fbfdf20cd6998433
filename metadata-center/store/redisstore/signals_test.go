package redisstore

import (
	"reflect"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// Reports are "waiting running kv_util prefill_tokens draining kv_capacity
// max_running reports_evictions prefill_queue token_seconds
// attention_seconds step_seconds step_left_seconds held_tokens
// held_step_seconds hold_left_seconds at"; the 14-field form written before
// the hold is read as no prompt held, the 13-field form
// written before the step left is read as no step in progress, the
// nine-field form written before the costs as reporting none, the
// eight-field form written before reports_evictions as not reporting them,
// the six-field form before the capacities without them, the five-field
// form before draining as not draining.
func TestStoredReportsOfEveryForm(t *testing.T) {
	s := &Store{signalMaxAge: 1000}
	for rep, want := range map[string]api.PodSignals{
		"1 2 0.5 7 1 4096 16 1 3:0.05,600:0.2 0.0005 1.1e-06 0.004 0.25 600 0.15 0.05 100": {Waiting: 1, Running: 2, KVCacheUtil: 0.5, PrefillTokens: 7, Draining: true, KVCapacity: 4096, MaxRunning: 16, ReportsEvictions: true,
			PrefillQueue: []api.Prefill{{Tokens: 3, Seconds: 0.05}, {Tokens: 600, Seconds: 0.2}}, TokenSeconds: 0.0005, AttentionSeconds: 1.1e-06, StepSeconds: 0.004, StepLeftSeconds: 0.25,
			HeldTokens: 600, HeldStepSeconds: 0.15, HoldLeftSeconds: 0.05, AgeMS: 100},
		"1 2 0.5 7 1 4096 16 1 3:0.05,4:0.2 0.0005 1.1e-06 0.004 0.25 100": {Waiting: 1, Running: 2, KVCacheUtil: 0.5, PrefillTokens: 7, Draining: true, KVCapacity: 4096, MaxRunning: 16, ReportsEvictions: true,
			PrefillQueue: []api.Prefill{{Tokens: 3, Seconds: 0.05}, {Tokens: 4, Seconds: 0.2}}, TokenSeconds: 0.0005, AttentionSeconds: 1.1e-06, StepSeconds: 0.004, StepLeftSeconds: 0.25, AgeMS: 100},
		"1 2 0.5 7 1 4096 16 1 3:0.05,4:0.2 0.0005 1.1e-06 0.004 100": {Waiting: 1, Running: 2, KVCacheUtil: 0.5, PrefillTokens: 7, Draining: true, KVCapacity: 4096, MaxRunning: 16, ReportsEvictions: true,
			PrefillQueue: []api.Prefill{{Tokens: 3, Seconds: 0.05}, {Tokens: 4, Seconds: 0.2}}, TokenSeconds: 0.0005, AttentionSeconds: 1.1e-06, StepSeconds: 0.004, AgeMS: 100},
		"1 2 0.5 7 1 4096 16 1 - 0.0005 0 0.004 100": {Waiting: 1, Running: 2, KVCacheUtil: 0.5, PrefillTokens: 7, Draining: true, KVCapacity: 4096, MaxRunning: 16, ReportsEvictions: true,
			TokenSeconds: 0.0005, StepSeconds: 0.004, AgeMS: 100},
		"1 2 0.5 7 1 4096 16 1 100": {Waiting: 1, Running: 2, KVCacheUtil: 0.5, PrefillTokens: 7, Draining: true, KVCapacity: 4096, MaxRunning: 16, ReportsEvictions: true, AgeMS: 100},
		"1 2 0.5 7 0 4096 16 0 100": {Waiting: 1, Running: 2, KVCacheUtil: 0.5, PrefillTokens: 7, KVCapacity: 4096, MaxRunning: 16, AgeMS: 100},
		"1 2 0.5 7 1 4096 16 100":   {Waiting: 1, Running: 2, KVCacheUtil: 0.5, PrefillTokens: 7, Draining: true, KVCapacity: 4096, MaxRunning: 16, AgeMS: 100},
		"1 2 0.5 7 1 100":           {Waiting: 1, Running: 2, KVCacheUtil: 0.5, PrefillTokens: 7, Draining: true, AgeMS: 100},
		"1 2 0.5 7 0 100":           {Waiting: 1, Running: 2, KVCacheUtil: 0.5, PrefillTokens: 7, AgeMS: 100},
		"1 2 0.5 7 100":             {Waiting: 1, Running: 2, KVCacheUtil: 0.5, PrefillTokens: 7, AgeMS: 100},
	} {
		got, ok, err := s.fresh(rep, 200)
		if err != nil || !ok || !reflect.DeepEqual(got, want) {
			t.Fatalf("%q: %+v %v %v, want %+v", rep, got, ok, err, want)
		}
	}
	for _, bad := range []string{"1 2 0.5 7 1 4096 16 1 - 0 0 0 0 x 0 0 100", "1 2 0.5 7 2 100", "1 2 0.5 100", "1 2 0.5 7 1 1 100", "1 2 0.5 7 1 x 16 100", "1 2 0.5 7 1 4096 16 2 100", "1 2 0.5 7 1 4096 16 1 x 0 0 0 100", "1 2 0.5 7 1 4096 16 1 3:x 0 0 0 100", "1 2 0.5 7 1 4096 16 1 - 0 0 0 x 100"} {
		if _, _, err := s.fresh(bad, 200); err == nil {
			t.Fatalf("%q read without error", bad)
		}
	}
}
