package routeload

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/gin-gonic/gin"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
)

// TestConnFraming reads answers framed every way a server may frame them,
// on one kept-alive connection, and redials after the server closes it.
func TestConnFraming(t *testing.T) {
	big := strings.Repeat("x", 9000)
	ts := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		switch r.URL.Path {
		case "/chunked": // no Content-Length, beyond net/http's buffer: chunked
			_, _ = io.WriteString(w, big)
		case "/close":
			w.Header().Set("Connection", "close")
			_, _ = w.Write(body)
		case "/fail":
			http.Error(w, "no such thing", http.StatusNotFound)
		default:
			_, _ = w.Write(body)
		}
	}))
	defer ts.Close()
	c, err := NewConn(ts.URL, "")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for i, tc := range []struct{ path, body, want, err string }{
		{path: "/echo", body: "hello", want: "hello"},
		{path: "/chunked", body: "", want: big},
		{path: "/echo", body: "again", want: "again"},
		{path: "/fail", body: "", err: "404 no such thing"},
		{path: "/close", body: "bye", want: "bye"},
		{path: "/echo", body: "redialled", want: "redialled"},
	} {
		got, err := c.PostRaw(tc.path, []byte(tc.body))
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Fatalf("%d %s: error %v, want %q", i, tc.path, err, tc.err)
			}
			continue
		}
		if err != nil || string(got) != tc.want {
			t.Fatalf("%d %s: %.20q, %v; want %.20q", i, tc.path, got, err, tc.want)
		}
	}
}

// TestCheckerChecksEveryAnswer makes sure an answer that differs from the
// prompt's reference is decoded and checked, not waved through.
func TestCheckerChecksEveryAnswer(t *testing.T) {
	gin.SetMode(gin.ReleaseMode)
	sc := Default()
	ts := httptest.NewServer(server.New(memstore.New(memstore.Options{}),
		server.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}).Handler())
	defer ts.Close()
	if err := sc.PopulateHTTP(context.Background(), NewClient(ts.URL, "", 1)); err != nil {
		t.Fatal(err)
	}
	c, err := NewConn(ts.URL, "")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	bodies := sc.Bodies()
	chk := &checker{s: sc, refs: make([]atomic.Pointer[[]byte], len(bodies))}
	raw, err := c.PostRaw(api.PathRouteQuery, bodies[3])
	if err != nil {
		t.Fatal(err)
	}
	good := string(raw)
	if err := chk.check(3, raw, nil); err != nil {
		t.Fatalf("a right answer fails: %v", err)
	}
	if err := chk.check(3, []byte(good), nil); err != nil {
		t.Fatalf("the same answer again fails: %v", err)
	}
	// One host's load left out: still valid JSON, no longer the scenario.
	i := strings.Index(good, `"10.0.0.2:8000":`)
	j := i + strings.Index(good[i:], "},") + 2
	if err := chk.check(3, []byte(good[:i]+good[j:]), nil); err == nil {
		t.Fatal("an answer lacking a host's load passes")
	}
	if err := chk.check(3, []byte(`{"load":{}`), nil); err == nil {
		t.Fatal("a truncated answer passes")
	}

	// The compact answer, checked the same way.
	c.Accept = api.MediaRouteCompact
	if raw, err = c.PostRaw(api.PathRouteQuery, bodies[5]); err != nil {
		t.Fatal(err)
	}
	if string(c.MediaType()) != api.MediaRouteCompact {
		t.Fatalf("answer served as %q", c.MediaType())
	}
	good = string(raw)
	if err := chk.check(5, raw, c.MediaType()); err != nil {
		t.Fatalf("a right compact answer fails: %v", err)
	}
	if err := chk.check(5, []byte(good), c.MediaType()); err != nil {
		t.Fatalf("the same compact answer again fails: %v", err)
	}
	// The last host's load triple left out.
	i = strings.LastIndex(good, "]")
	j = strings.LastIndex(good[:strings.LastIndex(good[:strings.LastIndex(good[:i], ",")], ",")], ",")
	if err := chk.check(5, []byte(good[:j]+good[i:]), c.MediaType()); err == nil {
		t.Fatalf("a compact answer lacking a host's load passes: %s", good[:j]+good[i:])
	}
}
