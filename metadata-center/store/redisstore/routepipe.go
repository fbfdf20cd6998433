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
	ks   []string
	args []any
	pods string // the cluster's registrations key, read beside the script
	res  []any
	regs map[string]string
	err  error
	done chan struct{} // closed once res, regs and err are set
}

// route runs the route script for one query and reads the cluster's pod
// registrations (pods, same slot) in the same pipeline, with whatever
// other queries are waiting. The caller stops waiting when ctx ends; the
// pipeline itself is bounded by the client's read and write timeouts.
func (s *Store) route(ctx context.Context, ks []string, args []any, pods string) ([]any, map[string]string, error) {
	c := &routeCall{ks: ks, args: args, pods: pods, done: make(chan struct{})}
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
		return c.res, c.regs, c.err
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
// go again with the script's source, as Script.Run would.
func (s *Store) routeBatch(batch []*routeCall) {
	ctx := context.Background()
	cmds := make([]*redis.Cmd, len(batch))
	regs := make([]*redis.MapStringStringCmd, len(batch))
	pipe := s.rdb.Pipeline()
	for i, c := range batch {
		cmds[i] = s.sc.route.EvalSha(ctx, pipe, c.ks, c.args...)
		regs[i] = pipe.HGetAll(ctx, c.pods)
	}
	_, _ = pipe.Exec(ctx)
	var again []int
	for i, cmd := range cmds {
		if err := cmd.Err(); err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") {
			again = append(again, i)
		}
	}
	if len(again) > 0 {
		pipe := s.rdb.Pipeline()
		for _, i := range again {
			cmds[i] = s.sc.route.Eval(ctx, pipe, batch[i].ks, batch[i].args...)
		}
		_, _ = pipe.Exec(ctx)
	}
	for i, c := range batch {
		c.res, c.err = cmds[i].Slice()
		if c.err == nil {
			c.regs, c.err = regs[i].Result()
		}
		close(c.done)
	}
}
