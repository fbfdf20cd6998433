package triton_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"regexp"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode"
	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode/openai"
	"github.com/istio-llm-filter/istio-llm-filter/filter/transcode/triton"
)

// FuzzTriton drives both directions with arbitrary input: a client body
// through the OpenAI parser and Translate, and arbitrary backend bytes
// through the response transcoder, whole and split into two chunks at any
// point. Nothing may panic; refusals are *transcode.Error with a 4xx; what
// goes to Triton and what comes back to the client is valid JSON / SSE of
// JSON events, and a split stream translates exactly like an unsplit one.
func FuzzTriton(f *testing.F) {
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":4}`),
		[]byte("data: {\"text_output\":\"he\"}\n\ndata: {\"text_output\":\"llo\"}\n\n"), uint16(7))
	f.Add([]byte(`{"model":"m","prompt":"a","stop":["x"],"seed":3}`), []byte(`{"text_output":"ok"}`), uint16(2))
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"u"}}]}]}`), []byte(`{"error":"x"}`), uint16(0))
	f.Add([]byte(`{"model":"m","prompt":"a","stream":true}`), []byte("data: {\"text_output\":\"\\ud83d\"}\r\n\r\ndata: [DONE]\n\n"), uint16(30))
	tc := triton.New(openai.Transcoder{})
	f.Fuzz(func(t *testing.T, body, answer []byte, cut uint16) {
		req, err := tc.Parse("/v1/chat/completions", body)
		if err != nil {
			var te *transcode.Error
			if !errors.As(err, &te) || te.Status < 400 || te.Status > 499 || te.Message == "" {
				t.Fatalf("parse refused without a 4xx transcode.Error: %#v", err)
			}
			return
		}
		up, err := tc.Upstream(req, "triton")
		if err != nil {
			var te *transcode.Error
			if !errors.As(err, &te) || te.Status < 400 || te.Status > 499 {
				t.Fatalf("translate refused without a 4xx transcode.Error: %#v", err)
			}
			return
		}
		if !json.Valid(up.Body) {
			t.Fatalf("Triton body is not JSON: %q", up.Body)
		}
		if up.Response == nil {
			t.Fatal("no response transcoder")
		}
		if !req.Stream {
			if out, err := up.Response.Body(answer); err == nil && !json.Valid(out) {
				t.Fatalf("translated body is not JSON: %q", out)
			}
			return
		}
		whole := streamAll(t, tc, req, [][]byte{answer})
		at := int(cut) % (len(answer) + 1)
		split := streamAll(t, tc, req, [][]byte{answer[:at], answer[at:]})
		if whole.err != split.err || !bytes.Equal(stable(whole.out), stable(split.out)) {
			t.Fatalf("split at %d changed the stream:\n%q (%s)\n%q (%s)", at, whole.out, whole.err, split.out, split.err)
		}
		if whole.err == "" {
			checkEvents(t, whole.out)
		}
	})
}

// stable blanks what differs between two transcoders of one request (each
// names its own completion id and creation second).
var unstable = regexp.MustCompile(`"id":"[^"]*"|"created":[0-9]+`)

func stable(b []byte) []byte { return unstable.ReplaceAll(b, nil) }

type streamed struct {
	out []byte
	err string // where the stream failed, "" if it did not
}

func streamAll(t *testing.T, tc triton.Transcoder, req *transcode.Request, chunks [][]byte) streamed {
	t.Helper()
	up, err := tc.Upstream(req, "triton")
	if err != nil {
		t.Fatal(err)
	}
	var s streamed
	for _, c := range chunks {
		out, err := up.Response.Chunk(c)
		s.out = append(s.out, out...)
		if err != nil {
			s.err = "chunk"
			return s
		}
	}
	out, err := up.Response.Flush()
	s.out = append(s.out, out...)
	if err != nil {
		s.err = "flush"
	}
	return s
}

// checkEvents: every SSE event is "data: <JSON>" or the final "data: [DONE]".
func checkEvents(t *testing.T, out []byte) {
	t.Helper()
	for _, ev := range bytes.Split(bytes.TrimSuffix(out, []byte("\n\n")), []byte("\n\n")) {
		if len(ev) == 0 {
			continue
		}
		data, ok := bytes.CutPrefix(ev, []byte("data: "))
		if !ok || (!bytes.Equal(data, []byte("[DONE]")) && !json.Valid(data)) {
			t.Fatalf("bad event %q in %q", ev, out)
		}
	}
}
