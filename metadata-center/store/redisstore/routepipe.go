package redisstore

import (
	"context"
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
	maps  []map[string]string // one per read
	err   error
	done  chan struct{} // closed once res, maps and err are set
}

// route runs the route script for one query and, in the same pipeline,
// HGETALLs each of reads (keys of the same slot, so still one round trip
// to one node), with whatever other queries are waiting. The reads follow
// the script, so they see its lease sweep. The caller stops waiting when
// ctx ends; the pipeline itself is bounded by the client's read and write
// timeouts.
func (s *Store) route(ctx context.Context, ks []string, args []any, reads []string) ([]any, []map[string]string, error) {
	c := &routeCall{ks: ks, args: args, reads: reads, done: make(chan struct{})}
	p := &s.routes
	p.mu.Lock()
	p.waiting = append(p.waiting, c)
	if p.senders < routeSenders {
		p.senders++
		go s.sendRoutes()
	}
	p.mu.Unlock()
	select {
	case <-c.done:
		return c.res, c.maps, c.err
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
		s.routeBatch(batch)
	}
}

// routeBatch sends one pipeline and hands each query its reply. Queries
// that meet NOSCRIPT (a flushed script cache, a freshly promoted replica)
// go again, reads included, with the script's source, as Script.Run would.
func (s *Store) routeBatch(batch []*routeCall) {
	ctx := context.Background()
	cmds := make([]*redis.Cmd, len(batch))
	reads := make([][]*redis.MapStringStringCmd, len(batch))
	send := func(idx []int, full bool) {
		pipe := s.rdb.Pipeline()
		for _, i := range idx {
			c := batch[i]
			if full {
				cmds[i] = s.sc.route.Eval(ctx, pipe, c.ks, c.args...)
			} else {
				cmds[i] = s.sc.route.EvalSha(ctx, pipe, c.ks, c.args...)
			}
			reads[i] = reads[i][:0]
			for _, k := range c.reads {
				reads[i] = append(reads[i], pipe.HGetAll(ctx, k))
			}
		}
		_, _ = pipe.Exec(ctx)
	}
	all := make([]int, len(batch))
	for i := range all {
		all[i] = i
	}
	send(all, false)
	var again []int
	for i, cmd := range cmds {
		if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			again = append(again, i)
		}
	}
	if len(again) > 0 {
		send(again, true)
	}
	for i, c := range batch {
		c.res, c.err = cmds[i].Slice()
		if c.err == nil {
			c.maps = make([]map[string]string, len(reads[i]))
			for j, r := range reads[i] {
				if c.maps[j], c.err = r.Result(); c.err != nil {
					break
				}
			}
		}
		close(c.done)
	}
}
