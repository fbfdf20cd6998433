package podsignals

import (
	"context"
	"reflect"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
)

// The fleet scrapes the listed pods and the announced ones, once each,
// but not an announced pod that registered (it pushes its own signals);
// an announcement lapses after its TTL unless renewed.
func TestFleetScrapesAnnouncedPodsThatDoNotPush(t *testing.T) {
	st := memstore.New(memstore.Options{})
	ctx := context.Background()
	if err := st.Register(ctx, "a", "10.0.0.3:8000", api.PodRegistration{Models: []string{"m"}}, time.Minute); err != nil {
		t.Fatal(err)
	}
	d := NewDiscovered()
	now := time.Unix(1000, 0)
	d.now = func() time.Time { return now }
	d.Announce("a", BackendVLLM, []string{"10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"}, 10*time.Second)
	d.Announce("b", BackendSGLang, []string{"10.0.1.1:30000"}, 20*time.Second)
	static := []Target{{Cluster: "a", Host: "10.0.0.1:8000", Backend: BackendVLLM}}
	f := &Fleet{Static: static, Discovered: d, Registry: st}
	want := []Target{
		{Cluster: "a", Host: "10.0.0.1:8000", Backend: BackendVLLM},
		{Cluster: "a", Host: "10.0.0.2:8000", Backend: BackendVLLM},
		{Cluster: "b", Host: "10.0.1.1:30000", Backend: BackendSGLang},
	}
	if got := f.Targets(); !reflect.DeepEqual(got, want) {
		t.Fatalf("targets %+v, want %+v", got, want)
	}
	now = now.Add(15 * time.Second) // cluster a's announcement lapsed
	if got := f.Targets(); !reflect.DeepEqual(got, []Target{want[0], want[2]}) {
		t.Fatalf("after a's TTL: %+v", got)
	}
	if len(d.m) != 1 {
		t.Fatalf("expired announcements kept: %v", d.m)
	}
	if got := (&Fleet{Static: static}).Targets(); !reflect.DeepEqual(got, static) {
		t.Fatalf("static only: %+v", got)
	}
}
