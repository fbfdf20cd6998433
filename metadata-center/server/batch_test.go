package server_test

import (
	"reflect"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/storetest"
)

// TestBatch drives POST /v1/batch on both stores: ordered application,
// the single calls' semantics, all-or-nothing validation with the index of
// the bad op, and the learned chunk size.
func TestBatch(t *testing.T) {
	for _, st := range storetest.Stores() {
		t.Run(st.Name, func(t *testing.T) { testBatch(t, serve(t, st.New(t), server.Options{})) })
	}
}

func testBatch(t *testing.T, c *client) {
	const a, b = "10.0.0.1:8000", "10.0.0.2:8000"
	var ans api.BatchAnswer
	c.ok("POST", api.PathBatch, api.Batch{Ops: []api.BatchOp{
		{Op: api.OpAddRequest, Cluster: cl, Host: a, RequestID: "r1", PromptLength: 100},
		{Op: api.OpCacheSave, Cluster: cl, Host: a, Hashes: hexes(0, 4), ChunkSize: 256},
		{Op: api.OpAddRequest, Cluster: cl, Host: "10.0.0.2:08000", RequestID: "r2", PromptLength: 9},
		{Op: api.OpFirstToken, Cluster: cl, Host: a, RequestID: "r1"},
		{Op: api.OpAddRequest, Cluster: cl, Host: a, RequestID: "r3", PromptLength: 1},
		{Op: api.OpDone, Cluster: cl, Host: a, RequestID: "r3"},
		{Op: api.OpDone, Cluster: cl, Host: a, RequestID: "unknown"},
	}}, &ans)
	if ans.Applied != 7 {
		t.Fatalf("applied = %d, want 7", ans.Applied)
	}
	want := api.LoadStats{a: {TotalReqs: 1, PromptLength: 0}, b: {TotalReqs: 1, PromptLength: 9}}
	if got := c.load(cl); !reflect.DeepEqual(got, want) {
		t.Fatalf("load = %v, want %v", got, want)
	}
	var locs []api.CacheLocation
	c.ok("POST", api.PathCacheQuery, api.CacheQuery{Cluster: cl, Hashes: hexes(0, 6)}, &locs)
	if w := []api.CacheLocation{{Host: a, Length: 4}}; !reflect.DeepEqual(locs, w) {
		t.Fatalf("cache = %v, want %v", locs, w)
	}
	// The batch's save taught the cluster's chunk size: a worker hashing
	// with another one is refused.
	c.fails("POST", api.PathCacheEvict, api.CacheEvict{Cluster: cl, Host: a, Hashes: hexes(0, 1), ChunkSize: 512},
		409, "chunk_size_mismatch", "chunk_size 512")

	// One bad op refuses the batch before anything is applied.
	for _, tc := range []struct {
		ops []api.BatchOp
		msg string
	}{
		{[]api.BatchOp{{Op: api.OpDone, Cluster: cl, Host: a, RequestID: "r1"}, {Op: "explode", Cluster: cl, Host: a}}, `ops[1] (explode): unknown op "explode"`},
		{[]api.BatchOp{{Op: api.OpDone, Cluster: cl, Host: a, RequestID: "r1"}, {Op: api.OpDone, Cluster: cl, Host: "nohost", RequestID: "x"}}, "ops[1] (done): host"},
		{[]api.BatchOp{{Op: api.OpDone, Cluster: cl, Host: a, RequestID: "r1"}, {Op: api.OpCacheSave, Cluster: cl, Host: a}}, "ops[1] (cache_save): hashes is required"},
		{[]api.BatchOp{{Op: api.OpDone, Cluster: cl, Host: a, RequestID: "r1"}, {Op: api.OpCacheSave, Cluster: cl, Host: a, Hashes: []string{"xyz"}}}, "ops[1] (cache_save): hashes[0]"},
		{[]api.BatchOp{{Op: api.OpAddRequest, Cluster: cl, Host: a, RequestID: "r9", PromptLength: -1}}, "ops[0] (add_request): prompt_length"},
		{[]api.BatchOp{{Op: api.OpDone, Cluster: cl, Host: a}}, "ops[0] (done): request_id is required"},
		{[]api.BatchOp{{Cluster: cl, Host: a}}, "ops[0] (): op is required"},
		{[]api.BatchOp{{Op: api.OpDone, Host: a, RequestID: "r"}}, "ops[0] (done): cluster is required"},
	} {
		c.fails("POST", api.PathBatch, api.Batch{Ops: tc.ops}, 400, "bad_request", tc.msg)
	}
	if got := c.load(cl); !reflect.DeepEqual(got, want) {
		t.Fatalf("load after refused batches = %v, want %v (nothing applied)", got, want)
	}
	c.fails("POST", api.PathBatch, `{}`, 400, "bad_request", "ops is required")
	c.fails("POST", api.PathBatch, `{"ops":[`, 400, "bad_request", "invalid JSON")
	many := make([]api.BatchOp, api.MaxBatchOps+1)
	for i := range many {
		many[i] = api.BatchOp{Op: api.OpDone, Cluster: cl, Host: a, RequestID: "r"}
	}
	c.fails("POST", api.PathBatch, api.Batch{Ops: many}, 400, "bad_request", "at most 1024")
	c.fails("GET", api.PathBatch, nil, 405, "method_not_allowed", "GET")
	c.ok("POST", api.PathBatch, api.Batch{Ops: []api.BatchOp{}}, &ans)
	if ans.Applied != 0 || !strings.Contains(string(mustRaw(t, c)), "llmf_metadata_center_batch_ops_total") {
		t.Fatalf("empty batch applied %d", ans.Applied)
	}
}

func mustRaw(t *testing.T, c *client) []byte {
	t.Helper()
	code, raw := c.do("GET", api.PathMetrics, nil)
	if code != 200 {
		t.Fatalf("metrics: %d", code)
	}
	return raw
}
