package redisstore

import (
	"context"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// pipeCounter counts the pipelines of EVALSHAs and holds the first sends
// until enough queries wait, so that the test sees them merged whatever
// the scheduler does.
type pipeCounter struct {
	s       *Store
	hold    int // release the first sends once this many queries wait
	held    atomic.Bool
	merged  atomic.Int64
	largest atomic.Int64
}

func (h *pipeCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *pipeCounter) wait() {
	if h.held.Load() {
		return
	}
	defer h.held.Store(true)
	wait.Until(10*time.Second, func() bool {
		h.s.routes.mu.Lock()
		n := len(h.s.routes.waiting)
		h.s.routes.mu.Unlock()
		return h.held.Load() || n >= h.hold
	})
}

func (h *pipeCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() == "evalsha" {
			h.wait()
		}
		return next(ctx, cmd)
	}
}

func (h *pipeCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		n := 0
		for _, c := range cmds {
			if c.Name() == "evalsha" {
				n++
			}
		}
		if n > 1 {
			h.merged.Add(1)
			for {
				old := h.largest.Load()
				if int64(n) <= old || h.largest.CompareAndSwap(old, int64(n)) {
					break
				}
			}
		}
		return next(ctx, cmds)
	}
}

// TestRoutePipe: 256 route queries from 32 goroutines over 4 routing
// clusters, on one node and on a real Redis Cluster (where the clusters'
// slots sit on different masters). Queries that wait for a pipeline are
// sent together, and every one gets exactly the answer it gets alone.
func TestRoutePipe(t *testing.T) {
	for _, kind := range []string{"node", "cluster"} {
		t.Run(kind, func(t *testing.T) {
			var st *Store
			var err error
			if kind == "node" {
				srv := redistest.Shared(t)
				st, err = New(Options{Addr: srv.Addr, KeyPrefix: srv.Prefix})
			} else {
				rc := redistest.StartCluster(t)
				st, err = New(Options{Addr: strings.Join(rc.Addrs, ","), Cluster: true, KeyPrefix: rc.Prefix})
			}
			if err != nil {
				t.Fatal(err)
			}
			defer st.Close()
			ctx := context.Background()
			clusters := []string{"outbound|8000||a.llm", "outbound|8000||b.llm", "outbound|8000||c.llm", "outbound|8000||d.llm"}
			prompt := func(c, p int) []prefix.Hash {
				hs := make([]prefix.Hash, 8)
				for i := range hs {
					hs[i] = prefix.Hash(uint64(c)<<40 | uint64(p%3)<<20 | uint64(i+1))
					if i < 4 {
						hs[i] = prefix.Hash(uint64(c)<<40 | uint64(i+1)) // shared by the cluster's prompts
					}
				}
				return hs
			}
			want := map[string]api.RouteAnswer{}
			for ci, c := range clusters {
				for p := range 3 {
					host := fmt.Sprintf("10.0.%d.%d:8000", ci, p+1)
					if err := st.SaveCacheAs(ctx, c, host, prompt(ci, p)[:4+2*p], "", 0, 0); err != nil {
						t.Fatal(err)
					}
					if err := st.AddLease(ctx, c, host, fmt.Sprintf("r%d", p), int64(100*p)); err != nil {
						t.Fatal(err)
					}
				}
			}
			for ci, c := range clusters {
				for p := range 3 {
					ans, err := st.Route(ctx, c, prompt(ci, p))
					if err != nil {
						t.Fatal(err)
					}
					if len(ans.Cache) == 0 || len(ans.Load) != 3 {
						t.Fatalf("alone: %+v", ans)
					}
					want[fmt.Sprint(ci, p)] = ans
				}
			}
			h := &pipeCounter{s: st, hold: 16}
			st.rdb.AddHook(h)
			burst := func(phase string) {
				h.held.Store(false)
				h.merged.Store(0)
				var wg sync.WaitGroup
				var failed atomic.Int64
				for g := range 32 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for i := range 8 {
							ci, p := (g+i)%len(clusters), (g*7+i)%3
							ans, err := st.Route(ctx, clusters[ci], prompt(ci, p))
							if err != nil || !reflect.DeepEqual(ans, want[fmt.Sprint(ci, p)]) {
								if failed.Add(1) == 1 {
									t.Errorf("%s: cluster %d prompt %d: %+v, %v; alone: %+v", phase, ci, p, ans, err, want[fmt.Sprint(ci, p)])
								}
							}
						}
					}()
				}
				wg.Wait()
				if h.merged.Load() == 0 {
					t.Fatalf("%s: no route queries were sent together", phase)
				}
				t.Logf("%s: %d pipelines of several queries, the largest %d", phase, h.merged.Load(), h.largest.Load())
			}
			burst("cached script")
			// A flushed script cache (a restart, a promoted replica): the
			// pipelined EVALSHAs meet NOSCRIPT and go again with the source.
			flush := func(ctx context.Context, c *redis.Client) error { return c.ScriptFlush(ctx).Err() }
			if st.cluster != nil {
				err = st.cluster.ForEachShard(ctx, flush)
			} else {
				err = flush(ctx, st.rdb.(*redis.Client))
			}
			if err != nil {
				t.Fatal(err)
			}
			burst("flushed script")
		})
	}
}
