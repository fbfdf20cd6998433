package store

import (
	"context"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// OpKind names the update an Op makes.
type OpKind uint8

// The updates a batch may carry: the Leases and Index methods of the same
// names.
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
	MaxEntries   int           // OpSaveCache: what host holds at most (Index.SaveCacheAs)
}

// Batcher applies a batch of updates.
type Batcher interface {
	// Apply runs ops in order. An error means some of them may not have
	// been applied; every op is idempotent, so applying a batch again is
	// safe.
	Apply(ctx context.Context, ops []Op) error
}

// Sequential applies a batch one call per op on Leases and Index: the
// Batcher of a store with no round trips to save (memstore).
type Sequential struct {
	Leases Leases
	Index  Index
}

// Apply implements Batcher.
func (q Sequential) Apply(ctx context.Context, ops []Op) error {
	for _, op := range ops {
		var err error
		switch op.Kind {
		case OpAddLease:
			err = q.Leases.AddLease(ctx, op.Cluster, op.Host, op.RequestID, op.PromptLength)
		case OpFirstToken:
			err = q.Leases.FirstToken(ctx, op.Cluster, op.Host, op.RequestID)
		case OpDeleteLease:
			err = q.Leases.DeleteLease(ctx, op.Cluster, op.Host, op.RequestID)
		case OpSaveCache:
			if op.RefreshOnly {
				err = q.Index.RefreshCache(ctx, op.Cluster, op.Host, op.Hashes, op.SaveID)
			} else {
				err = q.Index.SaveCacheAs(ctx, op.Cluster, op.Host, op.Hashes, op.SaveID, op.SavedAt, op.MaxEntries)
			}
		case OpRetractCache:
			err = q.Index.RetractCache(ctx, op.Cluster, op.Host, op.Hashes, op.SaveID)
		}
		if err != nil {
			return err
		}
	}
	return nil
}
