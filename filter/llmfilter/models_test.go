package llmfilter

import (
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"
)

// A POST without a body is refused with 400 at DecodeHeaders, and the
// reply is marked in the dynamic metadata for Envoy's local_reply_config.
func TestBodylessPostIs400AndMarked(t *testing.T) {
	conf, _ := newTestConfig(t, baseConfig(""))
	s := newStream(t, conf)
	h := reqHeaders("x-request-id", "empty", headers.Cluster, "somewhere")
	if st := s.phase(false, func() api.StatusType { return s.f.DecodeHeaders(h, true) }); st != api.LocalReply {
		t.Fatalf("DecodeHeaders = %v, want LocalReply", st)
	}
	ev := s.e.wait()
	if e := parseSeedError(t, ev); ev.code != 400 || e.TraceID != "empty" || e.Error.Type != "bad_request" {
		t.Fatalf("got %d %+v", ev.code, e)
	}
	if v := (fakeMeta{s.e}).Get(Name)[LocalReplyMetadataKey]; v != true {
		t.Fatalf("dynamic metadata %s.%s = %v, want true", Name, LocalReplyMetadataKey, v)
	}
	if _, ok := h.Get(headers.Cluster); ok {
		t.Fatal("the client's cluster header was kept")
	}
	s.end(nil)
}
