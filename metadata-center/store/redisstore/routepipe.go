package redisstore

import (
	"context"
	"errors"
	"strings"
	"sync"

	"github.com/redis/go-redis/v9"
)

// routeSenders is how many pipelines of route queries may be on their way
// at once: two, so that Redis has the next one queued while this side
// reads the last one's replies.
const routeSenders = 2

// routePipe sends the route queries that arrive while earlier ones are on
// their way to Redis together, as one pipeline. Every query is still one
// EVALSHA on one node, but a pipeline of k costs one write and one read
// on each side instead of k: on loopback those syscalls are a quarter of
// the metadata center's CPU per query and a good part of redis-server's
// outside the script (docs/metadata-center.md). A query on an idle store
// leaves at once; nothing waits for company.
type routePipe struct {
	mu      sync.Mutex
	waiting []*routeCall
	senders int
}

type routeCall struct {
	ks    []string
	args  []any
	reads []string // hashes of the cluster read after the script (same slot)
	res   []any
	pairs [][]string // one per read: field, value, field, value...
	err   error
	done  chan struct{} // closed once res, pairs and err are set; nil when the caller sends itself
}

// route runs the route script for one query and, in the same pipeline,
// HGETALLs each of reads (keys of the same slot, so still one round trip
// to one node), with whatever other queries are waiting. The reads follow
// the script, so they see its lease sweep. A query that finds nothing
// waiting and a sender free sends itself, within ctx, instead of handing
// itself to a new goroutine: at light load that is every query, and the
// handoff (a goroutine started, woken and waited for) is work it does not
// need. A waiting caller stops waiting when ctx
// ends; the pipeline it was in is bounded by the client's read and write
// timeouts.
func (s *Store) route(ctx context.Context, ks []string, args []any, reads []string) ([]any, [][]string, error) {
	c := &routeCall{ks: ks, args: args, reads: reads}
	p := &s.routes
	p.mu.Lock()
	if p.senders < routeSenders && len(p.waiting) == 0 {
		p.senders++
		p.mu.Unlock()
		s.routeBatch(ctx, []*routeCall{c})
		// Whatever queued meanwhile goes on without this caller.
		p.mu.Lock()
		if len(p.waiting) > 0 {
			go s.sendRoutes()
		} else {
			p.senders--
		}
		p.mu.Unlock()
		return c.res, c.pairs, c.err
	}
	c.done = make(chan struct{})
	p.waiting = append(p.waiting, c)
	if p.senders < routeSenders {
		p.senders++
		go s.sendRoutes()
	}
	p.mu.Unlock()
	select {
	case <-c.done:
		return c.res, c.pairs, c.err
	case <-ctx.Done():
		return nil, nil, ctx.Err()
	}
}

// sendRoutes sends what is waiting, again and again, until nothing is.
func (s *Store) sendRoutes() {
	p := &s.routes
	for {
		p.mu.Lock()
		batch := p.waiting
		p.waiting = nil
		if len(batch) == 0 {
			p.senders--
			p.mu.Unlock()
			return
		}
		p.mu.Unlock()
		s.routeBatch(context.Background(), batch)
	}
}

// routeBatch sends one pipeline and hands each query its reply. Queries
// that meet NOSCRIPT (a flushed script cache, a freshly promoted replica)
// go again, reads included, with the script's source, as Script.Run would;
// so do those a Redis Cluster node sent to another (see pipeliner).
func (s *Store) routeBatch(ctx context.Context, batch []*routeCall) {
	cmds := make([]*redis.Cmd, len(batch))
	reads := make([][]*redis.StringSliceCmd, len(batch))
	send := func(pipe redis.Pipeliner, idx []int, full bool) {
		for _, i := range idx {
			c := batch[i]
			if full {
				cmds[i] = s.sc.route.Eval(ctx, pipe, c.ks, c.args...)
			} else {
				cmds[i] = s.sc.route.EvalSha(ctx, pipe, c.ks, c.args...)
			}
			reads[i] = reads[i][:0]
			for _, k := range c.reads {
				reads[i] = append(reads[i], hgetall(ctx, pipe, k))
			}
		}
		_, _ = pipe.Exec(ctx)
	}
	all := make([]int, len(batch))
	for i := range all {
		all[i] = i
	}
	pipe, direct := s.pipeliner(ctx, batch)
	send(pipe, all, false)
	var again []int
	for i, cmd := range cmds {
		err := cmd.Err()
		if err == nil && direct {
			for _, r := range reads[i] {
				if err = r.Err(); err != nil {
					break
				}
			}
		}
		if err != nil && (redis.HasErrorPrefix(err, "NOSCRIPT") || direct && elsewhere(err)) {
			again = append(again, i)
		}
	}
	if len(again) > 0 {
		send(s.rdb.Pipeline(), again, true)
	}
	for i, c := range batch {
		c.res, c.err = cmds[i].Slice()
		if c.err == nil {
			c.pairs = make([][]string, len(reads[i]))
			for j, r := range reads[i] {
				if c.pairs[j], c.err = r.Result(); c.err != nil {
					break
				}
			}
		}
		if c.done != nil {
			close(c.done)
		}
	}
}

// hgetall is HGETALL read as a flat list of fields and values: go-redis's
// HGetAll builds a map, and the route query joined its two 64-host load
// maps into a third, a tenth of the metadata center's CPU per query;
// every caller only walks the pairs once.
func hgetall(ctx context.Context, c interface {
	Process(context.Context, redis.Cmder) error
}, key string) *redis.StringSliceCmd {
	cmd := redis.NewStringSliceCmd(ctx, "hgetall", key)
	_ = c.Process(ctx, cmd)
	return cmd
}

// pipeliner picks the pipeline for a batch. On a Redis Cluster whose
// batch all lives on one master (one routing cluster is one slot), it is
// that master's own client: the cluster client's pipeline starts a
// goroutine per node and sorts the commands by slot on every call, none
// of which a batch for one node needs. direct
// says so; the caller then resends through the cluster client whatever
// that node did not run (elsewhere), which follows redirects and retries.
func (s *Store) pipeliner(ctx context.Context, batch []*routeCall) (pipe redis.Pipeliner, direct bool) {
	if s.cluster == nil {
		return s.rdb.Pipeline(), false
	}
	var node *redis.Client
	for _, c := range batch {
		n, err := s.cluster.MasterForKey(ctx, c.ks[0])
		if err != nil || node != nil && n != node {
			return s.rdb.Pipeline(), false
		}
		node = n
	}
	return node.Pipeline(), true
}

// elsewhere tells a reply that says the command belongs to, or may now
// run on, another node (or that the node did not answer) from the
// script's own errors, which would fail the same anywhere.
func elsewhere(err error) bool {
	var rerr redis.Error
	if !errors.As(err, &rerr) {
		return true // network, timeout, closed pool
	}
	code, _, _ := strings.Cut(rerr.Error(), " ")
	switch code {
	case "MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN", "LOADING", "READONLY", "MASTERDOWN":
		return true
	}
	return false
}
