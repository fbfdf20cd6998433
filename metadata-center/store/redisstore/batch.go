package redisstore

import (
	"context"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
)

var _ store.Batcher = (*Store)(nil)

// Apply implements store.Batcher: the ops' scripts go out as one pipeline,
// so a batch costs one round trip per Redis node it touches (one on a
// single node; on a cluster, one per master holding a slot of the batch's
// routing clusters, sent in parallel). A pipeline runs in order on its
// connection, and one request's updates all name one routing cluster, so
// they run on one node in the order given.
//
// A script the node has not cached (first use, a flushed cache, a freshly
// promoted replica) answers NOSCRIPT and does not run; the ops from the
// first such one on are sent again with the full script source, which
// caches it. Ops after it that did run are run twice, harmlessly: every
// script is idempotent.
func (s *Store) Apply(ctx context.Context, ops []store.Op) error {
	if len(ops) == 0 {
		return nil
	}
	var reg []string
	for _, op := range ops {
		if (op.Kind == store.OpAddLease || op.Kind == store.OpSaveCache) && s.needsRegister(op.Cluster) {
			reg = append(reg, op.Cluster)
		}
	}
	from, err := s.applyPipe(ctx, ops, reg, false)
	if err == nil && from >= 0 {
		_, err = s.applyPipe(ctx, ops[from:], nil, true)
	}
	if err != nil {
		for _, c := range reg {
			s.forget(c)
		}
	}
	return err
}

// applyPipe sends ops (and the registry entries of reg) as one pipeline.
// It returns the index of the first op that met NOSCRIPT, or -1.
func (s *Store) applyPipe(ctx context.Context, ops []store.Op, reg []string, full bool) (int, error) {
	pipe := s.rdb.Pipeline()
	if len(reg) > 0 {
		pipe.SAdd(ctx, s.registry(), toAny(reg)...)
		pipe.PExpire(ctx, s.registry(), time.Duration(max(s.leaseTTL, s.cacheTTL))*time.Millisecond)
	}
	cmds := make([]*redis.Cmd, len(ops))
	for i, op := range ops {
		if (op.Kind == store.OpSaveCache || op.Kind == store.OpRetractCache) && len(op.Hashes) == 0 ||
			op.Kind == store.OpRetractCache && op.SaveID == "" {
			continue // as SaveCacheAs and RetractCache: nothing to do
		}
		sc, ks, args, err := s.opScript(op)
		if err != nil {
			return -1, err
		}
		if full {
			cmds[i] = sc.Eval(ctx, pipe, ks, args...)
		} else {
			cmds[i] = sc.EvalSha(ctx, pipe, ks, args...)
		}
	}
	_, _ = pipe.Exec(ctx)
	noscript := -1
	for i, cmd := range cmds {
		if cmd == nil {
			continue
		}
		err := cmd.Err()
		if err == nil {
			continue
		}
		if !full && redis.HasErrorPrefix(err, "NOSCRIPT") {
			if noscript < 0 {
				noscript = i
			}
			continue
		}
		return -1, s.wrap("batch", err)
	}
	return noscript, nil
}

// opScript returns the script, KEYS and ARGV of one op: the same the
// single calls send.
func (s *Store) opScript(op store.Op) (*redis.Script, []string, []any, error) {
	k := s.keys(op.Cluster)
	now := s.ms()
	switch op.Kind {
	case store.OpAddLease:
		return s.sc.add, k.leases(), []any{now, now + s.leaseTTL, s.leaseTTL, op.Host, member(op.Host, op.RequestID), op.PromptLength}, nil
	case store.OpFirstToken:
		return s.sc.firstToken, k.leases(), []any{now, op.Host, member(op.Host, op.RequestID)}, nil
	case store.OpDeleteLease:
		return s.sc.del, k.leases(), []any{now, op.Host, member(op.Host, op.RequestID)}, nil
	case store.OpSaveCache:
		ks, args := s.saveArgs(k, op.Host, op.Hashes, op.SaveID, op.RefreshOnly, op.SavedAt, op.MaxEntries)
		return s.sc.save, ks, args, nil
	case store.OpRetractCache:
		ks, args := s.unholdArgs(k, op.Host, op.Hashes, op.SaveID)
		return s.sc.retract, ks, args, nil
	}
	return nil, nil, nil, fmt.Errorf("redis batch: unknown op kind %d", op.Kind)
}

func toAny(ss []string) []any {
	out := make([]any, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}
