package chaos

import (
	"context"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/client"
	"github.com/istio-llm-filter/istio-llm-filter/bench/workload"
)

// Load is steady mixed traffic: Users simulated users, each running one
// conversation after another — multi-turn conversations (every turn resends
// the history) and single questions on shared system prompts — half of the
// requests streamed. It runs until its context ends and keeps every record.
type Load struct {
	Client    *Client
	Users     int
	MaxTokens int
	Seed      uint64
	// StreamShare is the share of the users' requests sent streamed.
	StreamShare float64

	start    time.Time
	mu       sync.Mutex
	records  []*Record
	inflight map[int]*flight
	nextID   int
}

type flight struct {
	rec     *Record
	stream  bool
	worker  string
	firstOK bool
}

// NewLoad prepares a load; Run or the one-off senders start requests.
func NewLoad(c *Client, users, maxTokens int, seed uint64, start time.Time) *Load {
	return &Load{Client: c, Users: users, MaxTokens: maxTokens, Seed: seed, StreamShare: 0.5, start: start, inflight: map[int]*flight{}}
}

// Run drives the users until ctx ends and waits for their last requests.
func (l *Load) Run(ctx context.Context) error {
	mt, err := workload.Generate(workload.Spec{Kind: "multi-turn", Seed: l.Seed, Sessions: 64, Turns: 6, SystemBytes: 1024, UserBytes: 200})
	if err != nil {
		return err
	}
	sp, err := workload.Generate(workload.Spec{Kind: "shared-prefix", Seed: l.Seed, Systems: 3, Users: 4, Questions: 16})
	if err != nil {
		return err
	}
	var wg sync.WaitGroup
	for u := range l.Users {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := rand.New(rand.NewPCG(l.Seed, uint64(u)))
			for i := u; ctx.Err() == nil; i += l.Users {
				if r.IntN(2) == 0 {
					l.session(ctx, r, mt[i%len(mt)], "multi-turn")
				} else {
					l.session(ctx, r, sp[i%len(sp)], "shared-prefix")
				}
			}
		}()
	}
	wg.Wait()
	return nil
}

func (l *Load) session(ctx context.Context, r *rand.Rand, s workload.Session, kind string) {
	var history []client.Message
	if s.System != "" {
		history = append(history, client.Message{Role: "system", Content: s.System})
	}
	for _, t := range s.Turns {
		if ctx.Err() != nil {
			return
		}
		history = append(history, client.Message{Role: "user", Content: t.User})
		// Once sent, a request runs to its answer even when the load is being
		// stopped: the end state is then the fleet's, not the client's.
		rec, answer := l.Send(context.WithoutCancel(ctx), kind, client.Request{Messages: history, Stream: r.Float64() < l.StreamShare, MaxTokens: l.MaxTokens}, r.IntN(len(l.Client.Gateways)))
		if rec.Outcome != OK {
			return // a conversation cannot go on without its answer
		}
		history = append(history, client.Message{Role: "assistant", Content: answer})
	}
}

// Send makes one request (with the client's retries), tracked as in
// flight while it runs, and records it. Requests cut short because the
// run itself ended are not recorded.
func (l *Load) Send(ctx context.Context, kind string, req client.Request, gateway int) (Record, string) {
	l.mu.Lock()
	id := l.nextID
	l.nextID++
	rec := &Record{ID: id, Kind: kind, Stream: req.Stream}
	f := &flight{rec: rec, stream: req.Stream}
	l.inflight[id] = f
	l.mu.Unlock()
	req.Progress = func(worker string, first bool) {
		l.mu.Lock()
		f.worker, f.firstOK = worker, f.firstOK || first
		l.mu.Unlock()
	}
	answer := l.Client.Do(ctx, req, gateway, l.start, rec)
	l.mu.Lock()
	delete(l.inflight, id)
	if ctx.Err() == nil || rec.Outcome == OK {
		l.records = append(l.records, rec)
	}
	l.mu.Unlock()
	return *rec, answer
}

// Burst sends n requests at once (half streamed), more than the workers'
// queues hold, and waits for them.
func (l *Load) Burst(ctx context.Context, n int, seed uint64) {
	sp, _ := workload.Generate(workload.Spec{Kind: "shared-prefix", Seed: seed, Systems: 2, Users: 2, Questions: 16})
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := sp[i%len(sp)]
			msgs := []client.Message{{Role: "system", Content: s.System}, {Role: "user", Content: s.Turns[0].User}}
			l.Send(ctx, "burst", client.Request{Messages: msgs, Stream: i%2 == 0, MaxTokens: l.MaxTokens}, i)
		}()
	}
	wg.Wait()
}

// Disconnects runs conc clients for d that each stream a request and go
// away after its first token, one after the other.
func (l *Load) Disconnects(ctx context.Context, d time.Duration, conc int, seed uint64) {
	mt, _ := workload.Generate(workload.Spec{Kind: "multi-turn", Seed: seed, Sessions: 16, Turns: 1, SystemBytes: 1024, UserBytes: 200})
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	var wg sync.WaitGroup
	for c := range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := c; ctx.Err() == nil; i += conc {
				s := mt[i%len(mt)]
				msgs := []client.Message{{Role: "system", Content: s.System}, {Role: "user", Content: s.Turns[0].User}}
				// The run's context, not the window's: the client leaves by
				// itself after the first token, not because the window closed.
				l.Send(context.WithoutCancel(ctx), "disconnect", client.Request{Messages: msgs, Stream: true, MaxTokens: 4 * l.MaxTokens, AbortAfterFirst: true}, i)
			}
		}()
	}
	wg.Wait()
}

// StreamingOn reports how many streams are in flight on worker with their
// first token already received.
func (l *Load) StreamingOn(worker string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, f := range l.inflight {
		if f.stream && f.firstOK && f.worker == worker {
			n++
		}
	}
	return n
}

// InFlight counts requests sent and not yet answered.
func (l *Load) InFlight() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.inflight)
}

// InFlightOn lists the ids of requests whose answer came from worker and
// is still running (the ones a kill of that worker interrupts).
func (l *Load) InFlightOn(worker string) []int {
	l.mu.Lock()
	defer l.mu.Unlock()
	var ids []int
	for id, f := range l.inflight {
		if f.worker == worker {
			ids = append(ids, id)
		}
	}
	return ids
}

// Records returns a copy of every finished request so far.
func (l *Load) Records() []Record {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make([]Record, len(l.records))
	for i, r := range l.records {
		out[i] = *r
	}
	return out
}
