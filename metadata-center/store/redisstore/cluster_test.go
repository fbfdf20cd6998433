package redisstore_test

import (
	"context"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/storetest"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

func newClusterStore(t testing.TB, rc *redistest.Cluster, o redisstore.Options) *redisstore.Store {
	t.Helper()
	o.Cluster = true
	o.Addr = strings.Join(rc.Addrs[:2], ",") // seeds: the rest is discovered
	if o.KeyPrefix == "" {
		o.KeyPrefix = rc.Prefix
	}
	st, err := redisstore.New(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = st.Close() })
	return st
}

// TestClusterContract runs the whole store contract on a real 6-node
// Redis Cluster: a script touching keys of two slots would fail there with
// CROSSSLOT, so passing shows every call stays within one slot.
func TestClusterContract(t *testing.T) {
	rc := redistest.StartCluster(t)
	storetest.Run(t, func(t *testing.T, cfg storetest.Config) store.Store {
		return newClusterStore(t, rc, redisstore.Options{
			KeyPrefix: rc.Prefix + "-" + strings.ReplaceAll(t.Name(), "/", "-"),
			LeaseTTL:  cfg.LeaseTTL, CacheTTL: cfg.CacheTTL, Now: cfg.Now,
		})
	})
}

func TestClusterSeedValidation(t *testing.T) {
	for _, addr := range []string{",", " , ", "127.0.0.1:1,nohostport"} {
		if _, err := redisstore.New(redisstore.Options{Addr: addr, Cluster: true}); err == nil {
			t.Errorf("New(Cluster, Addr %q) succeeded", addr)
		}
	}
}

// TestClusterOneRoundTrip counts, on every node, the scripts the store's
// calls run: once the cluster's registry entry is written and the slot
// map is known, each call is exactly one EVALSHA on one node (a script
// runs on one node by construction), and only masters run them.
func TestClusterOneRoundTrip(t *testing.T) {
	rc := redistest.StartCluster(t)
	st := newClusterStore(t, rc, redisstore.Options{})
	ctx := context.Background()
	clusters := []string{"outbound|8000||a.llm", "outbound|8000||b.llm", "outbound|8000||c.llm", "d"}
	hs := []prefix.Hash{1, 2, 3, 4}
	const host = "10.0.0.1:8000"
	calls := func() int {
		n := 0
		for _, c := range clusters {
			for _, err := range []error{
				st.AddLease(ctx, c, host, "r", 5),
				st.SaveCacheAs(ctx, c, host, hs, "", 0, 0),
				st.FirstToken(ctx, c, host, "r"),
				st.DeleteLease(ctx, c, host, "r"),
				st.EvictCacheBefore(ctx, c, host, hs[3:], 0),
			} {
				if err != nil {
					t.Fatal(err)
				}
			}
			if _, err := st.Route(ctx, c, hs); err != nil {
				t.Fatal(err)
			}
			if _, err := st.QueryCache(ctx, c, hs); err != nil {
				t.Fatal(err)
			}
			if _, err := st.LoadStats(ctx, c); err != nil {
				t.Fatal(err)
			}
			n += 8
		}
		return n
	}
	calls() // warm: registry writes, script loads, slot map

	nodes := make([]*redis.Client, len(rc.Addrs))
	for i, a := range rc.Addrs {
		nodes[i] = redis.NewClient(&redis.Options{Addr: a})
		defer nodes[i].Close()
		if err := nodes[i].ConfigResetStat(ctx).Err(); err != nil {
			t.Fatal(err)
		}
	}
	want := calls()
	got := 0
	used := make([]bool, len(nodes))
	for i, n := range nodes {
		info, err := n.Info(ctx, "commandstats").Result()
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(info, "\n") {
			name, rest, ok := strings.Cut(strings.TrimSpace(line), ":calls=")
			if !ok {
				continue
			}
			// Commands a script runs are counted too; EVALSHA itself
			// cannot be called from a script, so it counts round trips.
			if strings.TrimPrefix(name, "cmdstat_") != "evalsha" {
				continue
			}
			cnt, _ := strconv.Atoi(rest[:strings.IndexByte(rest, ',')])
			if cnt > 0 {
				used[i] = true
			}
			got += cnt
		}
	}
	if got != want {
		t.Fatalf("%d store calls ran %d scripts across the cluster, want one each", want, got)
	}
	for i, u := range used {
		if !u {
			continue
		}
		role, err := nodes[i].Do(ctx, "role").Slice()
		if err != nil {
			t.Fatal(err)
		}
		if role[0] != "master" {
			t.Errorf("node %d (%v) ran scripts", i, role[0])
		}
	}
}

// TestClusterRouteFollowsMovedSlot moves the routing cluster's slot to
// another master behind the store's back: the route query, which goes
// straight to the master its slot map names, meets MOVED there and must
// still answer, through the cluster client that follows the redirect.
func TestClusterRouteFollowsMovedSlot(t *testing.T) {
	rc := redistest.StartCluster(t)
	st := newClusterStore(t, rc, redisstore.Options{})
	ctx := context.Background()
	const cluster = "outbound|8000||moved.llm"
	const host = "10.0.0.1:8000"
	hs := []prefix.Hash{1, 2, 3}
	if err := st.SaveCacheAs(ctx, cluster, host, hs, "", 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := st.AddLease(ctx, cluster, host, "r", 7); err != nil {
		t.Fatal(err)
	}
	want, err := st.Route(ctx, cluster, hs) // the slot map is loaded now
	if err != nil {
		t.Fatal(err)
	}
	if len(want.Cache) != 1 || want.Load[host].TotalReqs != 1 {
		t.Fatalf("route before the move: %+v", want)
	}

	tag := "{" + rc.Prefix + ":" + cluster + "}"
	from := rc.MasterOf(tag)
	to := -1
	for i := range 3 { // any other master
		if m := rc.MasterOf(tag); i != m && isMaster(t, rc.Addrs[i]) {
			to = i
			break
		}
	}
	if to < 0 {
		t.Fatal("no other master")
	}
	src, dst := redis.NewClient(&redis.Options{Addr: rc.Addrs[from]}), redis.NewClient(&redis.Options{Addr: rc.Addrs[to]})
	defer src.Close()
	defer dst.Close()
	slot, err := src.ClusterKeySlot(ctx, tag).Result()
	if err != nil {
		t.Fatal(err)
	}
	srcID, dstID := src.Do(ctx, "cluster", "myid").Val(), dst.Do(ctx, "cluster", "myid").Val()
	must(t, dst.Do(ctx, "cluster", "setslot", slot, "importing", srcID).Err())
	must(t, src.Do(ctx, "cluster", "setslot", slot, "migrating", dstID).Err())
	keys, err := src.ClusterGetKeysInSlot(ctx, int(slot), 1000).Result()
	must(t, err)
	host2, port2, _ := strings.Cut(rc.Addrs[to], ":")
	args := []any{"migrate", host2, port2, "", 0, 5000, "keys"}
	for _, k := range keys {
		args = append(args, k)
	}
	must(t, src.Do(ctx, args...).Err())
	for _, c := range []*redis.Client{dst, src} {
		must(t, c.Do(ctx, "cluster", "setslot", slot, "node", dstID).Err())
	}
	if got := rc.MasterOf(tag); got != to {
		t.Fatalf("slot %d served by node %d after the move, want %d", slot, got, to)
	}

	got, err := st.Route(ctx, cluster, hs)
	if err != nil {
		t.Fatalf("route right after the move: %v", err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("route after the move = %+v, want %+v", got, want)
	}
}

func isMaster(t *testing.T, addr string) bool {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	role, err := c.Do(context.Background(), "role").Slice()
	if err != nil {
		t.Fatal(err)
	}
	return role[0] == "master"
}
