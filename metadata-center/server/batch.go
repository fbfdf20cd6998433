package server

import (
	"errors"
	"fmt"
	"time"

	"github.com/gin-gonic/gin"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
)

// batch is POST /v1/batch: a gateway's asynchronous updates of the last few
// milliseconds in one call. Every op is checked first, with the single
// calls' rules, so a bad one refuses the whole batch (400, naming its
// index) before anything is applied; then the store applies them in order,
// in one round trip where the store has round trips (store.Batcher).
func (s *Server) batch(c *gin.Context) {
	received := time.Now()
	var req api.Batch
	if !s.decode(c, &req) {
		return
	}
	switch {
	case req.Ops == nil:
		s.badRequest(c, errors.New("ops is required"))
		return
	case len(req.Ops) > api.MaxBatchOps:
		s.badRequest(c, fmt.Errorf("%d ops: at most %d per batch", len(req.Ops), api.MaxBatchOps))
		return
	}
	ops := make([]store.Op, len(req.Ops))
	for i, in := range req.Ops {
		op, err := validOp(in, received)
		if err != nil {
			s.badRequest(c, fmt.Errorf("ops[%d] (%s): %v", i, in.Op, err))
			return
		}
		ops[i] = op
	}
	ctx, cancel := s.storeCtx(c)
	defer cancel()
	if err := s.st.Batch.Apply(ctx, ops); err != nil {
		s.storeFailed(c, "batch", err)
		return
	}
	for i, in := range req.Ops {
		s.metrics.batchOps.WithLabelValues(in.Op).Inc()
		if ops[i].Kind == store.OpSaveCache {
			s.chunks.learn(ops[i].Cluster, in.ChunkSize)
		}
	}
	s.ok(c, api.BatchAnswer{Applied: len(ops)})
}

func validOp(in api.BatchOp, received time.Time) (store.Op, error) {
	if in.RefreshOnly && in.Op != api.OpCacheSave {
		return store.Op{}, fmt.Errorf("refresh_only is only allowed on %s", api.OpCacheSave)
	}
	switch in.Op {
	case api.OpAddRequest, api.OpFirstToken, api.OpDone:
		ref, err := validRef(in.Cluster, in.Host, in.RequestID)
		if err != nil {
			return store.Op{}, err
		}
		op := store.Op{Cluster: ref.Cluster, Host: ref.Host, RequestID: ref.RequestID}
		switch in.Op {
		case api.OpAddRequest:
			if err := validPromptLength(in.PromptLength); err != nil {
				return store.Op{}, err
			}
			op.Kind, op.PromptLength = store.OpAddLease, in.PromptLength
		case api.OpFirstToken:
			op.Kind = store.OpFirstToken
		default:
			op.Kind = store.OpDeleteLease
		}
		return op, nil
	case api.OpCacheSave:
		cluster, host, err := validClusterHost(in.Cluster, in.Host)
		if err != nil {
			return store.Op{}, err
		}
		if len(in.Hashes) == 0 {
			return store.Op{}, errors.New("hashes is required and must not be empty")
		}
		hashes, err := validHashes(in.Hashes)
		if err != nil {
			return store.Op{}, err
		}
		if err := validSaveID(in.SaveID, false); err != nil {
			return store.Op{}, err
		}
		at, err := savedAt(in.AgeMS, received)
		if err != nil {
			return store.Op{}, err
		}
		if err := validMaxEntries(in.MaxEntries); err != nil {
			return store.Op{}, err
		}
		return store.Op{Kind: store.OpSaveCache, Cluster: cluster, Host: host, Hashes: hashes, SaveID: in.SaveID,
			RefreshOnly: in.RefreshOnly, SavedAt: at, MaxEntries: in.MaxEntries}, nil
	case api.OpCacheRetract:
		r, err := validRetract(api.CacheRetract{Cluster: in.Cluster, Host: in.Host, Hashes: in.Hashes, SaveID: in.SaveID})
		if err != nil {
			return store.Op{}, err
		}
		r.Kind = store.OpRetractCache
		return r, nil
	case "":
		return store.Op{}, errors.New("op is required")
	}
	return store.Op{}, fmt.Errorf("unknown op %q (want %s, %s, %s, %s or %s)", in.Op, api.OpAddRequest, api.OpFirstToken, api.OpDone,
		api.OpCacheSave, api.OpCacheRetract)
}
