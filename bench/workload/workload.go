// Package workload generates the request mixes the routing benchmark replays.
//
// A workload is a list of sessions. A session is a conversation whose turns
// must run in order, because each turn's prompt carries the previous answers;
// single-shot workloads are sessions of one turn. Everything is derived from a
// seed, so two runs (and two policies compared in one run) replay the very
// same prompts in the same order.
package workload

import (
	"fmt"
	"math/rand/v2"
	"strings"
)

// Turn is one user message of a session; the executor appends the model's
// answers between turns.
type Turn struct {
	User string
}

// Session is a conversation: an optional system prompt and its user turns.
type Session struct {
	ID     string
	System string
	Turns  []Turn
	// Group names the prefix family (system prompt / user) the session shares,
	// for reporting; empty when nothing is shared.
	Group string
}

// Spec describes a workload.
type Spec struct {
	Kind string // shared-prefix | multi-turn | no-sharing | hot-prompt | kv-pressure
	Seed uint64

	// shared-prefix: Systems × Users × Questions single-turn requests.
	// kv-pressure: Systems × Users conversations of Turns turns.
	Systems, Users, Questions int
	// multi-turn: Sessions conversations of Turns turns each.
	Sessions, Turns int
	// no-sharing and hot-prompt: Requests single-turn requests.
	Requests int

	SystemBytes   int // length of a system prompt
	UserBytes     int // length of a user's context (shared-prefix) or a turn (multi-turn)
	QuestionBytes int // length of the final question
}

// Kinds lists the workloads Generate knows, in report order.
var Kinds = []string{"shared-prefix", "multi-turn", "no-sharing", "hot-prompt", "kv-pressure"}

// Defaults fills unset sizes with the workload's own defaults. They are
// chosen against the prompt hash's 512-byte blocks: shared parts span whole
// blocks (a router can only see shared prefixes block by block), and every
// kind's longest prompt fits the workers' context with several running.
func (s Spec) Defaults() Spec {
	def := func(v *int, d int) {
		if *v <= 0 {
			*v = d
		}
	}
	switch s.Kind {
	case "shared-prefix": // a RAG-style shared document, a user's history, a short question
		def(&s.Systems, 2)
		def(&s.Users, 4)
		def(&s.Questions, 32)
		def(&s.SystemBytes, 2048)
		def(&s.UserBytes, 1024)
		def(&s.QuestionBytes, 64)
	case "multi-turn": // long conversations: each turn resends the whole history
		// Four conversations per pod of the default 8: with two, how evenly
		// conversations are spread hardly shows at p90.
		def(&s.Sessions, 32)
		def(&s.Turns, 12)
		def(&s.SystemBytes, 1024)
		def(&s.UserBytes, 256)
	case "kv-pressure": // many users of a few long system prompts, long conversations
		// 12 system prompts × 3 users, as in the llm-d comparison the
		// workload was made for (docs/benchmarks.md); with small simulated
		// KV caches (bench --kv-cells 4096) the conversations do not all
		// fit, and pods evict.
		def(&s.Systems, 12)
		def(&s.Users, 3)
		def(&s.Turns, 6)
		def(&s.SystemBytes, 1024)
		def(&s.UserBytes, 128)
	default: // no-sharing, hot-prompt
		def(&s.Requests, 128)
		def(&s.SystemBytes, 1024)
		def(&s.QuestionBytes, 96)
	}
	if s.Seed == 0 {
		s.Seed = 1
	}
	return s
}

// Generate builds the sessions of a spec, shuffled deterministically.
func Generate(spec Spec) ([]Session, error) {
	s := spec.Defaults()
	r := rand.New(rand.NewPCG(s.Seed, 0x11f))
	var out []Session
	switch s.Kind {
	case "shared-prefix":
		systems := texts(r, "system", s.Systems, s.SystemBytes)
		users := texts(r, "profile", s.Users, s.UserBytes)
		for si := range systems {
			for ui := range users {
				for q := 0; q < s.Questions; q++ {
					out = append(out, Session{
						ID:     fmt.Sprintf("sp-%d-%d-%d", si, ui, q),
						Group:  fmt.Sprintf("s%d/u%d", si, ui),
						System: systems[si],
						Turns:  []Turn{{User: users[ui] + "\n" + Text(r, s.QuestionBytes)}},
					})
				}
			}
		}
	case "multi-turn":
		for i := 0; i < s.Sessions; i++ {
			sess := Session{ID: fmt.Sprintf("mt-%d", i), Group: fmt.Sprintf("mt-%d", i), System: Text(r, s.SystemBytes)}
			for t := 0; t < s.Turns; t++ {
				sess.Turns = append(sess.Turns, Turn{User: Text(r, s.UserBytes)})
			}
			out = append(out, sess)
		}
	case "kv-pressure":
		systems := texts(r, "system", s.Systems, s.SystemBytes)
		for si := range systems {
			for u := 0; u < s.Users; u++ {
				sess := Session{ID: fmt.Sprintf("kv-%d-%d", si, u), Group: fmt.Sprintf("s%d", si), System: systems[si]}
				for t := 0; t < s.Turns; t++ {
					sess.Turns = append(sess.Turns, Turn{User: Text(r, s.UserBytes)})
				}
				out = append(out, sess)
			}
		}
	case "no-sharing":
		for i := 0; i < s.Requests; i++ {
			out = append(out, Session{
				ID:     fmt.Sprintf("ns-%d", i),
				System: Text(r, s.SystemBytes),
				Turns:  []Turn{{User: Text(r, s.QuestionBytes)}},
			})
		}
	case "hot-prompt":
		hot := Text(r, s.SystemBytes)
		for i := 0; i < s.Requests; i++ {
			out = append(out, Session{
				ID:     fmt.Sprintf("hp-%d", i),
				Group:  "hot",
				System: hot,
				Turns:  []Turn{{User: Text(r, s.QuestionBytes)}},
			})
		}
	default:
		return nil, fmt.Errorf("workload: unknown kind %q (want one of %s)", s.Kind, strings.Join(Kinds, ", "))
	}
	r.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out, nil
}

func texts(r *rand.Rand, label string, n, size int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("[%s %d] ", label, i) + Text(r, size)
	}
	return out
}

var words = strings.Fields(`the a of to and in is for on that with as by this be are from at or an it
not which have has was were can will more all one their other into some time when about than
request model cache prefix token latency router gateway worker cluster mesh service queue batch
memory score load prompt answer system user question context history reply stream data value
order table index policy fleet node host route block hash chain window budget limit metric`)

// Text returns about n bytes of ASCII words (byte-level vocabularies make one
// byte one token, so n is also the token count on the generated model).
func Text(r *rand.Rand, n int) string {
	var b strings.Builder
	b.Grow(n + 16)
	for b.Len() < n {
		if b.Len() > 0 {
			b.WriteByte(' ')
		}
		b.WriteString(words[r.IntN(len(words))])
	}
	return b.String()[:n]
}
