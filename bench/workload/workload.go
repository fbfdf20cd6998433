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
	"math"
	"math/rand/v2"
	"strings"
	"time"
)

// Turn is one user message of a session; the executor appends the model's
// answers between turns.
type Turn struct {
	User string
	// MaxTokens is this turn's output length (max_tokens with ignore_eos);
	// 0 leaves it to the run's fixed length.
	MaxTokens int
	// Think is the pause before this turn is sent, after the previous
	// answer arrived (a user reading and typing); 0 sends it at once.
	Think time.Duration
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
	Kind string // one of Kinds
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

	// The field's standard workloads (Standard) give their sizes in tokens,
	// as their sources do; BytesPerToken (default 1, a byte-level
	// vocabulary) converts them to text of the engine's tokenizer. A byte
	// size set above wins over the token size.
	BytesPerToken                            float64
	SystemTokens, UserTokens, QuestionTokens int
	// OutputTokens is each request's output length; multi-turn-think draws
	// each turn's from [OutputMin, OutputMax] instead.
	OutputTokens, OutputMin, OutputMax int
	// ThinkTime is multi-turn-think's mean pause between a turn's answer
	// and the next turn (exponential, at most 4× the mean).
	ThinkTime time.Duration
}

// Classic are the project's own workloads; Standard the field's:
//
//   - generated-shared-prefix is SGLang bench_serving's
//     `--dataset-name generated-shared-prefix`: Systems groups × Questions
//     prompts, each a long system prompt shared by its group and a unique
//     question (its defaults: 64 × 16, 2,048 / 128 tokens, 256 out);
//   - shared-prefix-ladder is llm-d / inference-perf's `shared_prefix`
//     synthetic data (groups × prompts per group, system prompt and question
//     lengths, output length), meant to run as a rate ladder: the bench runs
//     it at increasing Poisson rates (bench --ladder) up to saturation;
//   - multi-turn-think: conversations whose users pause between turns and
//     whose answers are 128–512 tokens, as chat traffic is.
var (
	Classic  = []string{"shared-prefix", "multi-turn", "no-sharing", "hot-prompt", "kv-pressure"}
	Standard = []string{"generated-shared-prefix", "shared-prefix-ladder", "multi-turn-think"}
	// Kinds lists the workloads Generate knows, in report order.
	Kinds = append(append([]string{}, Classic...), Standard...)
)

// Ladder is the kind the bench runs as a rate ladder.
const Ladder = "shared-prefix-ladder"

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
	case "generated-shared-prefix": // SGLang bench_serving's defaults
		def(&s.Systems, 64)
		def(&s.Questions, 16)
		def(&s.SystemTokens, 2048)
		def(&s.QuestionTokens, 128)
		def(&s.OutputTokens, 256)
	case Ladder:
		// llm-d's prefix-cache guide runs 150 groups × 5 prompts of 6,000 /
		// 1,200 tokens with 1,000 out on GPUs; scaled to the simulated
		// fleet: 32 groups × 16, 2,048 / 256 tokens, 256 out.
		def(&s.Systems, 32)
		def(&s.Questions, 16)
		def(&s.SystemTokens, 2048)
		def(&s.QuestionTokens, 256)
		def(&s.OutputTokens, 256)
	case "multi-turn-think":
		def(&s.Sessions, 32)
		def(&s.Turns, 8)
		def(&s.SystemTokens, 1024)
		def(&s.UserTokens, 128)
		def(&s.OutputMin, 128)
		def(&s.OutputMax, 512)
		if s.ThinkTime <= 0 {
			s.ThinkTime = 3 * time.Second
		}
	default: // no-sharing, hot-prompt
		def(&s.Requests, 128)
		def(&s.SystemBytes, 1024)
		def(&s.QuestionBytes, 96)
	}
	if s.Seed == 0 {
		s.Seed = 1
	}
	if s.BytesPerToken <= 0 {
		s.BytesPerToken = 1
	}
	bytes := func(v *int, tokens int) {
		if *v <= 0 && tokens > 0 {
			*v = int(math.Round(float64(tokens) * s.BytesPerToken))
		}
	}
	bytes(&s.SystemBytes, s.SystemTokens)
	bytes(&s.UserBytes, s.UserTokens)
	bytes(&s.QuestionBytes, s.QuestionTokens)
	if s.OutputMax < s.OutputMin {
		s.OutputMax = s.OutputMin
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
	case "generated-shared-prefix", Ladder:
		prefix := map[string]string{"generated-shared-prefix": "gsp", Ladder: "spl"}[s.Kind]
		systems := texts(r, "system", s.Systems, s.SystemBytes)
		for g := range systems {
			for q := 0; q < s.Questions; q++ {
				out = append(out, Session{
					ID:     fmt.Sprintf("%s-%d-%d", prefix, g, q),
					Group:  fmt.Sprintf("g%d", g),
					System: systems[g],
					Turns:  []Turn{{User: Text(r, s.QuestionBytes), MaxTokens: s.OutputTokens}},
				})
			}
		}
	case "multi-turn-think":
		for i := 0; i < s.Sessions; i++ {
			sess := Session{ID: fmt.Sprintf("mtt-%d", i), Group: fmt.Sprintf("mtt-%d", i), System: Text(r, s.SystemBytes)}
			for t := 0; t < s.Turns; t++ {
				turn := Turn{User: Text(r, s.UserBytes), MaxTokens: s.OutputMin + r.IntN(s.OutputMax-s.OutputMin+1)}
				if t > 0 {
					turn.Think = time.Duration(min(r.ExpFloat64(), 4) * float64(s.ThinkTime))
				}
				sess.Turns = append(sess.Turns, turn)
			}
			out = append(out, sess)
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
