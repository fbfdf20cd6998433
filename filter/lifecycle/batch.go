package lifecycle

import (
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// newBatcher coalesces the lifecycle updates into POST /v1/batch calls
// (docs/metadata-center.md): with the route query that makes about one
// metadata-center call per request at load instead of five or six. Drops
// and failures are counted as with the per-update dispatcher.
func (l *Reporter) newBatcher(bs client.BatchSender) *client.Batcher {
	return client.NewBatcher(bs, client.BatcherOptions{
		Window:    l.cfg.Async.BatchWindow,
		MaxOps:    l.cfg.Async.BatchMaxOps,
		QueueSize: l.cfg.Async.QueueSize,
		Timeout:   l.cfg.MetadataCenter.UpdateTimeout,
		OnDrop: func(op api.BatchOp) {
			l.metrics.Count("async_dropped", 1)
			l.warn.Warn("metadata-center update dropped (queue full or closed)", "task", op.Op, "request_id", op.RequestID)
		},
		OnResult: func(ops []api.BatchOp, err error, took time.Duration) {
			l.metrics.Count("async_batches", 1)
			if err != nil {
				l.metrics.Count("async_errors", int64(len(ops)))
				l.metrics.Count("metadata_center_errors", 1)
				l.warn.Warn("metadata-center update batch failed", "updates", len(ops), "took", took, "err", err)
			}
		},
	})
}

// batchOp is the update a lifecycle step names (see dispatch's callers),
// for host: the chosen pod, or the one that really served (Served).
func (l *Reporter) batchOp(name string, d *Request, host string) api.BatchOp {
	op := api.BatchOp{Cluster: d.Cluster, Host: host, RequestID: d.RequestID}
	switch name {
	case "add_request":
		op.Op, op.PromptLength = api.OpAddRequest, int64(d.PrefillLength)
		if host != d.Host {
			op.PromptLength = int64(d.PromptLength) // the real pod holds none of it that we know of
		}
	case "first_token":
		op.Op = api.OpFirstToken
	case "delete_request":
		op.Op = api.OpDone
	case "save_cache", "refresh_cache", "place_cache":
		op = api.BatchOp{Op: api.OpCacheSave, Cluster: d.Cluster, Host: host, Hashes: d.Hashes, ChunkSize: l.chunk, SaveID: d.RequestID,
			RefreshOnly: name == "refresh_cache"}
		if name == "place_cache" {
			op.Hashes = d.placed() // the routing-time save (Started)
		}
		if host == d.Host {
			op.MaxEntries = d.MaxBlocks
		}
		if len(op.Hashes) > api.MaxHashes {
			op.Hashes = op.Hashes[:api.MaxHashes]
		}
	case "retract_cache":
		op = api.BatchOp{Op: api.OpCacheRetract, Cluster: d.Cluster, Host: host, Hashes: d.retractable(host), SaveID: d.RequestID}
	}
	return op
}

// placesPrefix says whether a decision's lease and routing-time save are
// sent without waiting for the batch window: when the pod must prefill at
// least two blocks of the prompt, the decision places a prefix (or a long
// prefill) that every gateway's next request of that prefix should see.
// (One block is what a follower's own question or a conversation's new
// turn usually adds.) Other gateways learn of it only through the metadata center, and
// the prefill takes far longer than the call, so the window is all the
// herd a cold start would get (docs/metadata-center.md). Requests that
// reuse what their pod holds keep the window: nobody routes on them.
func (l *Reporter) placesPrefix(d *Request) bool {
	block := l.chunk
	if block <= 0 {
		block = prefix.DefaultChunkSize
	}
	return len(d.Hashes) > 0 && d.PrefillLength >= 2*block
}

// startedUrgent queues a prefix-placing decision's lease and routing-time
// save together, past the batch window (placesPrefix).
func (l *Reporter) startedUrgent(d *Request, acked func(error)) {
	l.batch.AddUrgent(client.Update{Op: l.batchOp("add_request", d, d.Host), Done: acked},
		client.Update{Op: l.batchOp("place_cache", d, d.Host)})
}
