package e2e

import (
	"bufio"
	"context"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os/exec"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	mcclient "github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// workerProc starts the worker binary (sim engine) on addr and returns it
// once it logged "worker ready".
func workerProc(t *testing.T, bin, addr, mcURL string, extra ...string) *exec.Cmd {
	t.Helper()
	args := append([]string{"--engine", "sim", "--listen", addr, "--metadata-center", mcURL, "--cluster", "pool",
		"--advertise-host", addr, "--sim-step-overhead", "1ms"}, extra...)
	cmd := exec.Command(filepath.Join(bin, "worker"), args...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	up := make(chan struct{})
	go func() {
		sc := bufio.NewScanner(stderr)
		sent := false
		for sc.Scan() {
			if m := readyAddr.FindStringSubmatch(sc.Text()); m != nil && !sent {
				close(up)
				sent = true
			}
		}
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	select {
	case <-up:
	case <-time.After(time.Minute):
		t.Fatal("the worker never started")
	}
	return cmd
}

func readyz(t *testing.T, addr string) int {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/readyz")
	if err != nil {
		return -1
	}
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// A worker killed and restarted on the same address must not be trusted
// with what the index remembers of its previous process: the real worker
// process reports ready (/readyz, what Kubernetes probes) only once the
// real metadata center, on a real redis-server, acknowledged its start-up
// evict-all, which removes the earlier process's entries and keeps those
// saved for the new one (it carries the new process's start). With the
// metadata center out of reach, readiness comes after --ready-wait anyway,
// and the late evict-all still removes exactly the stale entries.
func TestRestartedWorkerIsReadyOnlyOnceItsOldIndexIsGone(t *testing.T) {
	bin := binaries(t)
	rd := redistest.Shared(t)
	st, err := redisstore.New(redisstore.Options{Addr: rd.Addr, KeyPrefix: rd.Prefix + "-restart"})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	mc := httptest.NewServer(server.New(st, server.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}).Handler())
	defer mc.Close()
	// The workers reach the metadata center through a gate that can cut
	// them off; the test (a gateway) always reaches it.
	var down atomic.Bool
	var refused atomic.Int64 // evict calls turned away
	target, _ := url.Parse(mc.URL)
	proxy := httputil.NewSingleHostReverseProxy(target)
	gate := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if down.Load() {
			if r.URL.Path == api.PathCacheEvict {
				refused.Add(1)
			}
			http.Error(w, `{"error":{"code":503,"type":"service_unavailable","message":"cut off"}}`, http.StatusServiceUnavailable)
			return
		}
		proxy.ServeHTTP(w, r)
	}))
	defer gate.Close()
	gw, err := mcclient.New(mcclient.Options{Address: mc.URL})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	save := func(hs ...prefix.Hash) {
		t.Helper()
		if err := gw.SaveCache(ctx, api.CacheSave{Cluster: "pool", Host: addr, Hashes: prefix.Wire(hs)}); err != nil {
			t.Fatal(err)
		}
	}
	held := func(h prefix.Hash) bool {
		t.Helper()
		ans, err := gw.Route(ctx, "pool", prefix.Wire([]prefix.Hash{h}))
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range ans.Cache {
			if c.Host == addr {
				return true
			}
		}
		return false
	}
	waitFor := func(what string, within time.Duration, cond func() bool) {
		t.Helper()
		wait.For(t, within, what, cond)
	}
	// The evict-all removes entries saved at or before the process's start,
	// in milliseconds; a save meant to survive it waits for the clock to
	// leave the millisecond the process (ready by now) started in.
	afterStart := func() {
		t.Helper()
		ready := time.Now().UnixMilli()
		waitFor("the next millisecond", time.Second, func() bool { return time.Now().UnixMilli() > ready })
	}

	first := workerProc(t, bin, addr, gate.URL)
	waitFor("the first process to be ready", 10*time.Second, func() bool { return readyz(t, addr) == 200 })
	save(1, 2)                                   // the gateways route prompts to it
	if err := first.Process.Kill(); err != nil { // kill -9: no goodbye
		t.Fatal(err)
	}
	_ = first.Wait()

	// Restarted while the metadata center is out of its reach: not ready,
	// however long that takes (no bound), and the index still holds the
	// dead process's entries.
	down.Store(true)
	refused.Store(0)
	second := workerProc(t, bin, addr, gate.URL, "--ready-wait", "0")
	afterStart()
	save(3) // routed to the new process meanwhile
	// The evict-all refused, retried, refused again: still not ready.
	for n := int64(1); n <= 3; n++ {
		waitFor("the worker's evict-all", 10*time.Second, func() bool { return refused.Load() >= n })
		if code := readyz(t, addr); code != 503 {
			t.Fatalf("/readyz answered %d after %d refused evict-alls", code, refused.Load())
		}
	}
	if !held(1) || !held(3) {
		t.Fatal("the index lost entries while the worker could not reach it")
	}
	down.Store(false)
	waitFor("readiness once the evict-all landed", 10*time.Second, func() bool { return readyz(t, addr) == 200 })
	if held(1) || held(2) || !held(3) {
		t.Fatalf("after the evict-all: 1 %v, 2 %v, 3 %v; want only 3, saved after the restart", held(1), held(2), held(3))
	}
	save(4)

	// The bounded wait: out of reach again, a restart reports ready after
	// --ready-wait; the late evict-all still removes only what was saved
	// before this process started.
	if err := second.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	_ = second.Wait()
	down.Store(true)
	start := time.Now()
	workerProc(t, bin, addr, gate.URL, "--ready-wait", "700ms")
	afterStart()
	save(5)
	if code := readyz(t, addr); code != 503 {
		t.Fatalf("/readyz answered %d at once", code)
	}
	waitFor("readiness after --ready-wait", 10*time.Second, func() bool { return readyz(t, addr) == 200 })
	if waited := time.Since(start); waited < 600*time.Millisecond {
		t.Fatalf("ready after %v, before --ready-wait", waited)
	}
	down.Store(false)
	waitFor("the late evict-all", 10*time.Second, func() bool { return !held(3) && !held(4) })
	if !held(5) {
		t.Fatal("the late evict-all removed an entry saved for the new process")
	}
}
