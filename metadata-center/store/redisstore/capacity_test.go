package redisstore_test

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

func infoField(b *testing.B, rdb *redis.Client, section, field string) string {
	b.Helper()
	info, err := rdb.Info(context.Background(), section).Result()
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			return v
		}
	}
	return ""
}

func usecPerCall(b *testing.B, rdb *redis.Client) float64 {
	v := infoField(b, rdb, "commandstats", "cmdstat_evalsha")
	for _, kv := range strings.Split(v, ",") {
		if s, ok := strings.CutPrefix(kv, "usec_per_call="); ok {
			f, _ := strconv.ParseFloat(s, 64)
			return f
		}
	}
	return 0
}

// BenchmarkCapacity measures, on a private redis-server, what the capacity
// page (docs/capacity.md) is derived from: Redis memory per index entry
// (one host holding one prefix hash) when each prefix has one holder and
// when it has eight, memory per live lease, and Redis CPU per call (from
// INFO commandstats) of a save, a route query (with and without the TTL
// refresh), a lease add and a batch of a request's four updates. b.N is
// ignored; the sizes are fixed.
//
//	go test -run '^$' -bench Capacity -benchtime 1x ./metadata-center/store/redisstore/
func BenchmarkCapacity(b *testing.B) {
	srv := redistest.Start(b)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	st, err := redisstore.New(redisstore.Options{Addr: srv.Addr, KeyPrefix: "cap"})
	if err != nil {
		b.Fatal(err)
	}
	defer st.Close()
	ctx := context.Background()
	mem := func() int64 {
		n, _ := strconv.ParseInt(infoField(b, rdb, "memory", "used_memory"), 10, 64)
		return n
	}
	reset := func() {
		if err := rdb.ConfigResetStat(ctx).Err(); err != nil {
			b.Fatal(err)
		}
	}
	const cluster = "outbound|8000||qwen.llm.svc.cluster.local"
	host := func(i int) string { return fmt.Sprintf("10.%d.%d.%d:8000", i/65536, i/256%256, i%256) }
	prompt := func(p, blocks int) []prefix.Hash {
		hs := make([]prefix.Hash, blocks)
		for i := range hs {
			hs[i] = prefix.Hash(uint64(p)<<20 | uint64(i) | 1<<63)
		}
		return hs
	}
	const blocks, prompts = 64, 500

	// One holder per prefix: 500 hosts, each its own 64-block prompt.
	base := mem()
	reset()
	for p := range prompts {
		if err := st.SaveCacheAs(ctx, cluster, host(p), prompt(p, blocks), "", 0, 0); err != nil {
			b.Fatal(err)
		}
	}
	saveCPU := usecPerCall(b, rdb)
	one := float64(mem()-base) / float64(prompts*blocks)

	// Eight holders per prefix: 8 more hosts save the same 500 prompts.
	base = mem()
	for p := range prompts {
		for h := 1; h <= 8; h++ {
			if err := st.SaveCacheAs(ctx, "eight", host(h), prompt(p, blocks), "", 0, 0); err != nil {
				b.Fatal(err)
			}
		}
	}
	eight := float64(mem()-base) / float64(prompts*blocks*8)

	// Route queries over the one-holder index (64 blocks, one candidate):
	// the first pass finds every entry older than the touch interval and
	// refreshes its TTL (a hot prefix pays that at most once a second),
	// the second pass is the common read-only query.
	routes := func() float64 {
		reset()
		for p := range prompts {
			if _, err := st.Route(ctx, cluster, prompt(p, blocks)); err != nil {
				b.Fatal(err)
			}
		}
		return usecPerCall(b, rdb)
	}
	refreshCPU := routes()
	routeCPU := routes()

	// Leases: 10,000 live ones over 500 hosts.
	base = mem()
	reset()
	for i := range 10000 {
		if err := st.AddLease(ctx, cluster, host(i%prompts), fmt.Sprintf("req-%d", i), 4096); err != nil {
			b.Fatal(err)
		}
	}
	addCPU := usecPerCall(b, rdb)
	lease := float64(mem()-base) / 10000

	// A request's four updates as one batch (add, save, first token, done).
	reset()
	for i := range prompts {
		id := fmt.Sprintf("batch-%d", i)
		if err := st.Apply(ctx, []store.Op{
			{Kind: store.OpAddLease, Cluster: cluster, Host: host(i), RequestID: id, PromptLength: 4096},
			{Kind: store.OpSaveCache, Cluster: cluster, Host: host(i), Hashes: prompt(i, blocks)},
			{Kind: store.OpFirstToken, Cluster: cluster, Host: host(i), RequestID: id},
			{Kind: store.OpDeleteLease, Cluster: cluster, Host: host(i), RequestID: id},
		}); err != nil {
			b.Fatal(err)
		}
	}
	batchCPU := usecPerCall(b, rdb) * 4 // usec_per_call is per EVALSHA; a batch runs four

	b.ReportMetric(one, "B/entry_1holder")
	b.ReportMetric(eight, "B/entry_8holders")
	b.ReportMetric(lease, "B/lease")
	b.ReportMetric(saveCPU, "redis_us/save64")
	b.ReportMetric(routeCPU, "redis_us/route64")
	b.ReportMetric(refreshCPU, "redis_us/route64_refresh")
	b.ReportMetric(addCPU, "redis_us/add")
	b.ReportMetric(batchCPU, "redis_us/request_updates")
}
