package main

import (
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
)

// TestRedisClusterFailoverNoClientErrors runs the whole path on real
// parts: clients → standalone gateway → two upstream pods, with the
// gateway's route queries and updates going to a metadata center on a
// 6-node Redis Cluster. The master serving the routing cluster's slot is
// SIGKILLed under load. Every client request must still succeed: the
// gateway routes without metadata (load-blind) while the metadata center
// answers 503, and cache-aware routing resumes by itself once a replica
// has been promoted.
func TestRedisClusterFailoverNoClientErrors(t *testing.T) {
	gin.SetMode(gin.ReleaseMode)
	rc := redistest.StartCluster(t)
	st, err := redisstore.New(redisstore.Options{Cluster: true, Addr: strings.Join(rc.Addrs[:3], ","), KeyPrefix: rc.Prefix})
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	mc := httptest.NewServer(server.New(st, server.Options{
		StoreTimeout: 300 * time.Millisecond,
		Logger:       slog.New(slog.NewTextHandler(io.Discard, nil)),
	}).Handler())
	defer mc.Close()

	pod := func() *httptest.Server {
		return httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			w.Header().Set("content-type", "application/json")
			fmt.Fprint(w, `{"object":"chat.completion","choices":[{"message":{"role":"assistant","content":"hi"}}]}`)
		}))
	}
	p1, p2 := pod(), pod()
	defer p1.Close()
	defer p2.Close()

	base := startGateway(t, fmt.Sprintf(`
listen: 127.0.0.1:0
log_level: error
filter:
  metadata_center: {address: %s, query_timeout: 500ms}
  model_mapping_rule:
    qwen:
      - cluster: tiny-pool
        backend: llamacpp
  lb_mapping_rule:
    default: {policy: cache_aware}
  endpoints:
    static: {tiny-pool: [%s, %s]}
`, mc.URL, p1.Listener.Addr(), p2.Listener.Addr()))
	counter := func(event string) int64 {
		resp, err := http.Get(base + "/metrics")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		m := regexp.MustCompile(`(?m)^llm_filter_` + event + `_total (\d+)`).FindSubmatch(b)
		if m == nil {
			return 0
		}
		n, _ := strconv.ParseInt(string(m[1]), 10, 64)
		return n
	}

	var ok, bad atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	hc := &http.Client{Timeout: 10 * time.Second}
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				// A few shared conversations, so cache hits are possible.
				body := fmt.Sprintf(`{"model":"qwen","messages":[{"role":"system","content":%q},{"role":"user","content":"q%d"}]}`,
					strings.Repeat("you are a helpful assistant. ", 40), (w+i)%3)
				resp, err := hc.Post(base+"/v1/chat/completions", "application/json", strings.NewReader(body))
				if err != nil {
					bad.Add(1)
					t.Errorf("client request failed: %v", err)
					continue
				}
				b, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					bad.Add(1)
					t.Errorf("client request answered %d: %s", resp.StatusCode, b)
					continue
				}
				ok.Add(1)
			}
		}()
	}
	defer func() {
		select {
		case <-stop:
		default:
			close(stop)
		}
		wg.Wait()
	}()

	waitFor := func(what string, within time.Duration, cond func() bool) {
		t.Helper()
		if !wait.Until(within, cond) {
			t.Fatalf("%s: not within %v (ok %d, bad %d)", what, within, ok.Load(), bad.Load())
		}
	}
	waitFor("cache-aware routing before the kill", 10*time.Second, func() bool { return counter("cache_hit_routes") > 20 })
	errsBefore := counter("metadata_center_errors")

	victim := rc.MasterOf("{" + rc.Prefix + ":tiny-pool}")
	killed := time.Now()
	rc.Kill(victim)
	waitFor("degraded routing after the kill", 10*time.Second, func() bool { return counter("metadata_center_errors") > errsBefore })

	// Recovered: no new metadata-center errors for a second, and cache
	// hits counted again after that.
	var lastErrs int64 = -1
	quietSince := time.Now()
	waitFor("recovery", 20*time.Second, func() bool {
		if n := counter("metadata_center_errors"); n != lastErrs {
			lastErrs, quietSince = n, time.Now()
			return false
		}
		return time.Since(quietSince) > time.Second
	})
	recovered := quietSince.Sub(killed)
	hits := counter("cache_hit_routes")
	waitFor("cache hits after recovery", 10*time.Second, func() bool { return counter("cache_hit_routes") > hits+20 })
	close(stop)
	wg.Wait()
	t.Logf("client requests ok %d, failed %d; metadata-center errors during failover %d; recovered %v after the kill",
		ok.Load(), bad.Load(), lastErrs-errsBefore, recovered)
	if bad.Load() != 0 {
		t.Fatalf("%d client requests failed during the failover", bad.Load())
	}
}
