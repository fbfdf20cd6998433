package standalone

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"
)

// trailerFilter records the trailer phases and adds a tail in
// EncodeTrailers, as the project's filter does for a transcoded stream.
type trailerFilter struct {
	*testFilter
}

func (f trailerFilter) DecodeTrailers(t api.RequestTrailerMap) api.StatusType {
	v, _ := t.Get("x-body-digest")
	f.rec.add("DecodeTrailers x-body-digest=%s", v)
	t.Set("x-filter-saw", "yes")
	return api.Continue
}

func (f trailerFilter) EncodeTrailers(t api.ResponseTrailerMap) api.StatusType {
	v, _ := t.Get("x-backend-stats")
	f.rec.add("EncodeTrailers x-backend-stats=%s", v)
	f.cb.EncoderFilterCallbacks().AddData([]byte("|tail"), true)
	return api.Continue
}

// Trailers both ways, driven as Envoy drives them: after StopAndBuffer the
// whole request body arrives in DecodeData(endStream=false), then
// DecodeTrailers; the request trailers (as the filter left them) reach the
// backend; the response's last EncodeData has endStream=false, then
// EncodeTrailers, whose AddData lands before the trailers the client gets.
func TestTrailersBothWaysInEnvoysOrder(t *testing.T) {
	for _, buffered := range []bool{false, true} {
		t.Run(fmt.Sprintf("buffered_response=%v", buffered), func(t *testing.T) {
			var gotBody string
			var gotTrailers http.Header
			backend := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				b, _ := io.ReadAll(r.Body)
				gotBody, gotTrailers = string(b), r.Trailer.Clone()
				w.Header().Set("Trailer", "X-Backend-Stats")
				w.Header().Set("content-type", "text/plain")
				io.WriteString(w, "part1|")
				w.(http.Flusher).Flush()
				io.WriteString(w, "part2")
				w.Header().Set("X-Backend-Stats", "ok")
			})
			var h *harness
			h = newHarness(t, backend, Options{}, nil)
			h.script = func(f *testFilter) {
				f.decodeData = pin(h.backendAddr())
				if buffered {
					f.encodeHeaders = func(*testFilter, api.ResponseHeaderMap, bool) api.StatusType { return api.StopAndBuffer }
				}
			}
			// Wrap the scripted filter so it has the trailer phases.
			inner := h.gwFactory()
			h.setFactory(func(c any, cb api.FilterCallbackHandler) api.StreamFilter {
				return trailerFilter{inner(c, cb).(*testFilter)}
			})

			body := strings.Repeat("question ", 4000)
			req, _ := http.NewRequest("POST", h.gw.URL+"/v1/chat/completions", io.NopCloser(strings.NewReader(body)))
			req.ContentLength = -1
			req.Trailer = http.Header{"X-Body-Digest": {"abc123"}}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			out, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 || string(out) != "part1|part2|tail" {
				t.Fatalf("client got %d %q, want the body then the tail added in EncodeTrailers", resp.StatusCode, out)
			}
			if resp.Trailer.Get("X-Backend-Stats") != "ok" {
				t.Fatalf("client trailers %v, want the backend's", resp.Trailer)
			}
			if gotBody != body || gotTrailers.Get("X-Body-Digest") != "abc123" || gotTrailers.Get("X-Filter-Saw") != "yes" {
				t.Fatalf("backend got %d bytes, trailers %v", len(gotBody), gotTrailers)
			}
			calls := h.rec().list()
			want := []string{
				"DecodeHeaders end=false",
				fmt.Sprintf("DecodeData len=%d end=false", len(body)),
				"DecodeTrailers x-body-digest=abc123",
				"EncodeHeaders status=200 end=false",
			}
			for i, w := range want {
				if i >= len(calls) || calls[i] != w {
					t.Fatalf("calls = %q, want prefix %q", calls, want)
				}
			}
			var enc []string
			for _, c := range calls[len(want):] {
				if strings.HasPrefix(c, "Encode") {
					enc = append(enc, c)
				}
			}
			// No EncodeData ever sees endStream=true; the trailers come last.
			if len(enc) < 2 || enc[len(enc)-1] != "EncodeTrailers x-backend-stats=ok" {
				t.Fatalf("encode calls %q: want EncodeData(end=false)... then EncodeTrailers", enc)
			}
			for _, c := range enc[:len(enc)-1] {
				if c != "EncodeData end=false" {
					t.Fatalf("encode calls %q: want every EncodeData with end=false", enc)
				}
			}
			if buffered && len(enc) != 2 {
				t.Fatalf("buffered response: encode calls %q, want one EncodeData with the whole body", enc)
			}
		})
	}
}
