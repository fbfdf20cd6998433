package epp_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/epp"
	"github.com/istio-llm-filter/istio-llm-filter/filter/epp/envoyrun"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

type answer struct {
	status int
	served string // x-llm-upstream-host
	body   string
	header http.Header
}

func post(t *testing.T, url, body string, hdr map[string]string) answer {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("content-type", "application/json")
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return answer{resp.StatusCode, resp.Header.Get(headers.UpstreamHost), string(b), resp.Header}
}

func chat(stream bool, msgs ...string) string {
	type m struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	var ms []m
	for i, s := range msgs {
		ms = append(ms, m{[]string{"user", "assistant"}[i%2], s})
	}
	b, _ := json.Marshal(map[string]any{"model": "qwen", "messages": ms, "stream": stream})
	return string(b)
}

// errType is the type of an answer in the project's error format.
func errType(t *testing.T, a answer) string {
	t.Helper()
	var e struct {
		Error struct {
			Code int    `json:"code"`
			Type string `json:"type"`
		} `json:"error"`
		TraceID string `json:"trace_id"`
	}
	if err := json.Unmarshal([]byte(a.body), &e); err != nil || e.Error.Code != a.status || e.TraceID == "" {
		t.Fatalf("%d %q is not the project's error format (%v)", a.status, a.body, err)
	}
	return e.Error.Type
}

// The picker behind the real Envoy: each request goes to the pod the
// picker named, the answer names it, streams flow, and refused requests
// get the project's JSON errors.
func TestThroughRealEnvoy(t *testing.T) {
	for _, mode := range []string{"buffered", "full-duplex"} {
		t.Run(mode, func(t *testing.T) { throughRealEnvoy(t, mode == "full-duplex") })
	}
}

func throughRealEnvoy(t *testing.T, duplex bool) {
	pods := startPods(t, 3)
	url := startEnvoyMode(t, startEPP(t, fleetFile("", addrs(pods)), true), duplex)

	t.Run("plain", func(t *testing.T) {
		a := post(t, url, chat(false, "hello there"), nil)
		if a.status != 200 || !slices.Contains(addrs(pods), a.served) || !strings.Contains(a.body, a.served) {
			t.Fatalf("answer %d served by %q: %s", a.status, a.served, a.body)
		}
		// The decision's prediction is stated as on the filter's path.
		ttft, err := strconv.ParseFloat(a.header.Get(headers.PredictedTTFT), 64)
		share, err2 := strconv.ParseFloat(a.header.Get(headers.PredictedCachedShare), 64)
		if err != nil || err2 != nil || ttft <= 0 || share < 0 || share > 1 {
			t.Fatalf("%s %q, %s %q: want milliseconds and a share of the prompt", headers.PredictedTTFT,
				a.header.Get(headers.PredictedTTFT), headers.PredictedCachedShare, a.header.Get(headers.PredictedCachedShare))
		}
	})
	t.Run("stream", func(t *testing.T) {
		req, _ := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", strings.NewReader(chat(true, "stream me")))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		served := resp.Header.Get(headers.UpstreamHost)
		events := 0
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if line := sc.Text(); strings.HasPrefix(line, "data: {") {
				if !strings.Contains(line, served) {
					t.Fatalf("event %q is not from %s", line, served)
				}
				events++
			}
		}
		if resp.StatusCode != 200 || events != 3 {
			t.Fatalf("status %d, %d events", resp.StatusCode, events)
		}
	})
	t.Run("the destination header reaches the pod", func(t *testing.T) {
		a := post(t, url, chat(false, "where do I go"), nil)
		for _, p := range pods {
			if p.addr != a.served {
				continue
			}
			seen := p.requests()
			got := seen[len(seen)-1].Get(epp.DestinationHeader)
			if got != a.served {
				t.Fatalf("the pod got %s: %q, want itself", epp.DestinationHeader, got)
			}
		}
	})
	t.Run("unknown model", func(t *testing.T) {
		a := post(t, url, `{"model":"nope","messages":[{"role":"user","content":"x"}]}`, nil)
		if a.status != 404 || errType(t, a) != "not_found" {
			t.Fatalf("%d %s", a.status, a.body)
		}
	})
	t.Run("bad JSON", func(t *testing.T) {
		a := post(t, url, `{"model":`, nil)
		if a.status != 400 || errType(t, a) != "bad_request" {
			t.Fatalf("%d %s", a.status, a.body)
		}
	})
	t.Run("no body goes to a pod", func(t *testing.T) {
		resp, err := http.Get(url + "/v1/models")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if served := resp.Header.Get(headers.UpstreamHost); resp.StatusCode != 200 || !strings.Contains(string(b), served) || served == "" {
			t.Fatalf("%d from %q: %s", resp.StatusCode, served, b)
		}
	})
	t.Run("conformance selection header", func(t *testing.T) {
		for _, p := range pods {
			for range 3 {
				a := post(t, url, chat(false, "pick "+p.addr), map[string]string{epp.TestSelectionHeader: p.addr})
				if a.status != 200 || a.served != p.addr || a.header.Get(epp.TestServedHeader) != p.addr {
					t.Fatalf("asked for %s: %d served by %q (echo %q)", p.addr, a.status, a.served, a.header.Get(epp.TestServedHeader))
				}
			}
		}
		a := post(t, url, chat(false, "nobody"), map[string]string{epp.TestSelectionHeader: "10.9.9.9"})
		if a.status != 503 || errType(t, a) != "service_unavailable" {
			t.Fatalf("a selection of no pod: %d %s", a.status, a.body)
		}
	})
}

// A pod that died is ejected after the first request Envoy could not
// deliver to it (Envoy answers that one itself, unseen by ext_proc), and
// the next requests go to the living pods.
func TestDeadPodIsEjected(t *testing.T) {
	pods := startPods(t, 2)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close()
	url := startEnvoy(t, startEPP(t, fleetFile("", append(addrs(pods), dead)), true))
	a := post(t, url, chat(false, "to the dead"), map[string]string{epp.TestSelectionHeader: dead})
	if a.status != 503 {
		t.Fatalf("the dead pod answered %d", a.status)
	}
	wait.For(t, 10*time.Second, "the dead pod to be left out", func() bool {
		a := post(t, url, chat(false, "anyone"), map[string]string{epp.TestSelectionHeader: dead})
		return a.status == 503 && strings.Contains(a.body, "service_unavailable")
	})
	for range 6 {
		if a := post(t, url, chat(false, "the living"), nil); a.status != 200 || a.served == dead {
			t.Fatalf("%d from %s", a.status, a.served)
		}
	}
}

// The InferencePool's failureMode when the picker is unreachable:
// FailClose (Envoy's ext_proc failure_mode_allow false, the default)
// answers 500 without reaching a pod; FailOpen (failure_mode_allow true)
// forwards the request to a pod of the gateway's own choosing, which
// needs a cluster that knows the pool's pods (envoyrun.Options.Pool).
// With the picker up, that cluster sends each request to the pod the
// picker named.
func TestFailureMode(t *testing.T) {
	bin := envoyBinary(t)
	pods := startPods(t, 2)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := ln.Addr().String()
	ln.Close()
	start := func(t *testing.T, o envoyrun.Options) string {
		o.Binary = bin
		e, err := envoyrun.Start(context.Background(), o)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = e.Close() })
		return e.URL()
	}
	served := func(a answer) string {
		for _, p := range pods {
			if strings.Contains(a.body, p.addr) {
				return p.addr
			}
		}
		return ""
	}
	t.Run("fail open, picker down", func(t *testing.T) {
		url := start(t, envoyrun.Options{EPP: down, FailOpen: true, Pool: addrs(pods)})
		seen := map[string]bool{}
		for range 4 {
			a := post(t, url, chat(false, "anyone there"), nil)
			if a.status != 200 || served(a) == "" {
				t.Fatalf("fail-open with the picker down: %d %s", a.status, a.body)
			}
			seen[served(a)] = true
		}
		if len(seen) != 2 {
			t.Errorf("Envoy's own round robin used %v, want both pods", seen)
		}
	})
	for _, pool := range [][]string{nil, addrs(pods)} {
		t.Run(fmt.Sprintf("fail closed, picker down, pool listed %v", pool != nil), func(t *testing.T) {
			before := len(pods[0].requests()) + len(pods[1].requests())
			a := post(t, start(t, envoyrun.Options{EPP: down, Pool: pool}), chat(false, "anyone there"), nil)
			if a.status != http.StatusInternalServerError {
				t.Fatalf("fail-closed with the picker down: %d %s, want 500", a.status, a.body)
			}
			if after := len(pods[0].requests()) + len(pods[1].requests()); after != before {
				t.Fatalf("a pod got the request")
			}
		})
	}
	t.Run("fail open, picker up: its choice", func(t *testing.T) {
		url := start(t, envoyrun.Options{EPP: startEPP(t, fleetFile("", addrs(pods)), true), FailOpen: true, Pool: addrs(pods)})
		for _, p := range pods {
			for range 2 {
				a := post(t, url, chat(false, "to "+p.addr), map[string]string{epp.TestSelectionHeader: p.addr})
				if a.status != 200 || served(a) != p.addr || a.served != p.addr {
					t.Fatalf("the picker named %s: %d served by %q (%q)", p.addr, a.status, served(a), a.served)
				}
			}
		}
	})
}
