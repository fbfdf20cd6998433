package store

import (
	"context"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// OpKind names the update an Op makes.
type OpKind uint8

// The updates a batch may carry: the Store methods of the same names.
const (
	OpAddLease OpKind = iota + 1
	OpFirstToken
	OpDeleteLease
	OpSaveCache
	OpRetractCache
)

// Op is one update of a batch, with validated, canonical fields.
type Op struct {
	Kind         OpKind
	Cluster      string
	Host         string
	RequestID    string        // lease ops
	PromptLength int64         // OpAddLease
	Hashes       []prefix.Hash // OpSaveCache, OpRetractCache
	SaveID       string        // OpSaveCache (may be empty), OpRetractCache
	RefreshOnly  bool          // OpSaveCache: RefreshCache rather than SaveCacheAs
	SavedAt      int64         // OpSaveCache: when the save was made (Unix ms; 0: now)
}

// Batcher is implemented by stores that apply a batch of updates in one
// round trip to their backing store (Redis: one pipeline).
type Batcher interface {
	// Apply runs ops in order. An error means some of them may not have
	// been applied; every op is idempotent, so applying a batch again is
	// safe.
	Apply(ctx context.Context, ops []Op) error
}

// Apply runs ops in order on st: in one round trip when st is a Batcher,
// else one call per op (an in-memory store has no round trips to save).
func Apply(ctx context.Context, st Store, ops []Op) error {
	if b, ok := st.(Batcher); ok {
		return b.Apply(ctx, ops)
	}
	for _, op := range ops {
		var err error
		switch op.Kind {
		case OpAddLease:
			err = st.AddLease(ctx, op.Cluster, op.Host, op.RequestID, op.PromptLength)
		case OpFirstToken:
			err = st.FirstToken(ctx, op.Cluster, op.Host, op.RequestID)
		case OpDeleteLease:
			err = st.DeleteLease(ctx, op.Cluster, op.Host, op.RequestID)
		case OpSaveCache:
			if op.RefreshOnly {
				err = st.RefreshCache(ctx, op.Cluster, op.Host, op.Hashes, op.SaveID)
			} else {
				err = st.SaveCacheAs(ctx, op.Cluster, op.Host, op.Hashes, op.SaveID, op.SavedAt)
			}
		case OpRetractCache:
			err = st.RetractCache(ctx, op.Cluster, op.Host, op.Hashes, op.SaveID)
		}
		if err != nil {
			return err
		}
	}
	return nil
}
