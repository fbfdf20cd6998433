package main

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
)

// The worker echoes the gateway's X-Request-Id and names it in its error
// answers; a request without one gets a fresh id, echoed the same way.
func TestErrorsCarryTheTraceID(t *testing.T) {
	url := start(t, "--engine", "sim", "--sim-step-overhead", "1ms")
	for _, tc := range []struct{ trace, body string }{
		{"trace-7", `{"model":"m","messages":[`},                                // malformed JSON: 400
		{"", `{"model":"m","messages":[{"role":"user","content":"x"}],"n":17}`}, // refused option: 400
	} {
		req, _ := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", strings.NewReader(tc.body))
		if tc.trace != "" {
			req.Header.Set("X-Request-Id", tc.trace)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var out struct {
			TraceID string `json:"trace_id"`
		}
		json.NewDecoder(resp.Body).Decode(&out)
		resp.Body.Close()
		echoed := resp.Header.Get("X-Request-Id")
		if resp.StatusCode != 400 || echoed == "" || out.TraceID != echoed || (tc.trace != "" && echoed != tc.trace) {
			t.Errorf("%s: status %d, header %q, body trace_id %q; want 400 naming %q", tc.body, resp.StatusCode, echoed, out.TraceID, tc.trace)
		}
	}
}
