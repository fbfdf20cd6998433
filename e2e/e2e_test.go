package e2e

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"

	"github.com/istio-llm-filter/istio-llm-filter/bench/fleet"
	"github.com/istio-llm-filter/istio-llm-filter/bench/workload"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/cgoenv"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	mcclient "github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
	"github.com/istio-llm-filter/istio-llm-filter/worker/testmodel"
)

var (
	buildOnce sync.Once
	binDir    string
	buildErr  error
)

// binaries builds the commands once per test binary, with the same
// vector flags as the Makefile so the llama.cpp build is shared with it.
func binaries(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		root, err := exec.Command("go", "env", "GOMOD").Output()
		if err != nil {
			buildErr = err
			return
		}
		binDir, buildErr = os.MkdirTemp("", "llmf-e2e-bin-")
		if buildErr != nil {
			return
		}
		cmd := exec.Command("go", "build", "-o", binDir+"/",
			"./metadata-center/cmd/metadata-center", "./worker/cmd/worker", "./filter/cmd/gateway", "./filter/cmd/epp", "./worker/cmd/mkmodel")
		cmd.Dir = filepath.Dir(strings.TrimSpace(string(root)))
		cmd.Env = cgoenv.Environ()
		if out, err := cmd.CombinedOutput(); err != nil {
			buildErr = err
			t.Logf("go build:\n%s", out)
		}
	})
	if buildErr != nil {
		t.Fatalf("building the binaries: %v", buildErr)
	}
	return binDir
}

func startFleet(t *testing.T) *fleet.Fleet {
	t.Helper()
	if testing.Short() {
		t.Skip("starts llama.cpp workers")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	// The metadata center keeps its state in a real Redis, as deployed.
	rd := redistest.Shared(t)
	f, err := fleet.Start(ctx, fleet.Spec{
		BinDir: binaries(t), LogDir: t.TempDir(), Engine: "llama", Workers: 3,
		Store: "redis", RedisAddr: rd.Addr, RedisPrefix: rd.Prefix,
		Model: testmodel.Path(t), ModelName: "tiny", Policy: "cache_aware",
		// Three workers share two cores: one thread each keeps them from
		// thrashing; small queues keep failures quick.
		WorkerArgs: []string{"--threads", "1", "--n-ctx", "8192", "--n-seq-max", "8"},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		f.Stop()
		if t.Failed() {
			dumpLogs(t, f)
		}
	})
	return f
}

func dumpLogs(t *testing.T, f *fleet.Fleet) {
	matches, _ := filepath.Glob(filepath.Join(f.LogDir, "*.log"))
	for _, m := range matches {
		b, _ := os.ReadFile(m)
		if len(b) > 4000 {
			b = b[len(b)-4000:]
		}
		t.Logf("--- %s (tail)\n%s", filepath.Base(m), b)
	}
}

// turn is one answered request of a conversation.
type turn struct {
	worker              string
	answer              string
	prompt, cached, gen int64
	status              int
	// hashes are the request's prompt block hashes as the gateway computes
	// them (its canonical form, the default chunk size), for recorded.
	hashes []prefix.Hash
}

// conversation is a multi-turn chat replayed through the SDK.
type conversation struct {
	msgs   []openai.ChatCompletionMessageParamUnion
	canon  []prefix.Message // msgs as the gateway hashes them
	stream bool
}

func text(role, content string) prefix.Message {
	return prefix.ChatMessage(role, "", "", []prefix.Part{{Type: "text", Text: content}}, nil)
}

func newConversation(stream bool, seed uint64) *conversation {
	sys := workload.Text(newRand(seed), 1500) // three 512-byte blocks and more
	return &conversation{stream: stream, msgs: []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(sys)},
		canon: []prefix.Message{text("system", sys)}}
}

// ask sends the next user message and, on success, appends the answer.
func (c *conversation) ask(t *testing.T, cl openai.Client, user string) (turn, error) {
	t.Helper()
	c.msgs = append(c.msgs, openai.UserMessage(user))
	params := openai.ChatCompletionNewParams{
		Model:       "tiny",
		Messages:    c.msgs,
		MaxTokens:   openai.Int(12),
		Temperature: openai.Float(0),
	}
	var resp *http.Response
	var tr turn
	ctx := context.Background()
	// Random weights may say EOS at any step: fixed-length answers (vLLM's
	// and llama-server's ignore_eos) keep the turns comparable.
	opts := []option.RequestOption{option.WithResponseInto(&resp), option.WithJSONSet("ignore_eos", true)}
	if c.stream {
		params.StreamOptions = openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)}
		s := cl.Chat.Completions.NewStreaming(ctx, params, opts...)
		var b strings.Builder
		chunks := 0
		for s.Next() {
			ch := s.Current()
			for _, choice := range ch.Choices {
				b.WriteString(choice.Delta.Content)
			}
			if ch.Usage.PromptTokens > 0 {
				tr.prompt, tr.cached, tr.gen = ch.Usage.PromptTokens, ch.Usage.PromptTokensDetails.CachedTokens, ch.Usage.CompletionTokens
			}
			chunks++
		}
		if err := s.Err(); err != nil {
			c.msgs = c.msgs[:len(c.msgs)-1]
			return tr, err
		}
		if chunks < 3 {
			t.Fatalf("a streamed answer came in %d chunks", chunks)
		}
		tr.answer = b.String()
	} else {
		out, err := cl.Chat.Completions.New(ctx, params, opts...)
		if err != nil {
			c.msgs = c.msgs[:len(c.msgs)-1]
			return tr, err
		}
		tr.answer = out.Choices[0].Message.Content
		tr.prompt, tr.cached, tr.gen = out.Usage.PromptTokens, out.Usage.PromptTokensDetails.CachedTokens, out.Usage.CompletionTokens
	}
	tr.worker = resp.Header.Get(headers.UpstreamHost)
	tr.status = resp.StatusCode
	if tr.worker == "" || tr.prompt == 0 || tr.gen != 12 {
		t.Fatalf("answer lacks routing or usage: %+v", tr)
	}
	tr.hashes = prefix.Hasher{}.Sum("tiny", prefix.CanonicalChat(append(c.canon, text("user", user))))
	c.msgs = append(c.msgs, openai.AssistantMessage(tr.answer))
	c.canon = append(c.canon, text("user", user), text("assistant", tr.answer))
	return tr, nil
}

// recorded waits until the metadata center at mcURL holds tr's whole
// prompt on the worker that answered it: the gateway saves the location
// asynchronously when the answer starts, and the conversation's next turn
// is routed by it.
func recorded(t *testing.T, mcURL string, tr turn) {
	t.Helper()
	mc, err := mcclient.New(mcclient.Options{Address: mcURL})
	if err != nil {
		t.Fatal(err)
	}
	var last *api.RouteAnswer
	held := wait.Until(30*time.Second, func() bool {
		var ans *api.RouteAnswer
		if ans, err = mc.Route(context.Background(), fleet.Cluster, prefix.Wire(tr.hashes)); err != nil {
			return false
		}
		last = ans
		for _, c := range ans.Cache {
			if c.Host == tr.worker && c.Length == len(tr.hashes) {
				return true
			}
		}
		return false
	})
	if !held {
		t.Fatalf("the metadata center never held the %d-block prompt on %s: %+v, %v", len(tr.hashes), tr.worker, last, err)
	}
}

func TestConversationKeepsLandingOnItsKVCache(t *testing.T) {
	f := startFleet(t)
	for gi, gw := range gateways(t, f) {
		cl := clientAt(gw.url, 0)
		for _, stream := range []bool{false, true} {
			name := gw.name + "/" + map[bool]string{false: "json", true: "sse"}[stream]
			seed := uint64(10*gi) + map[bool]uint64{false: 1, true: 2}[stream]
			t.Run(name, func(t *testing.T) { conversationSticks(t, f.MC, cl, stream, seed) })
		}
	}
}

func conversationSticks(t *testing.T, mcURL string, cl openai.Client, stream bool, seed uint64) {
	c := newConversation(stream, seed)
	first, err := c.ask(t, cl, "Tell me about prefix caches.")
	if err != nil {
		t.Fatal(err)
	}
	prev := first
	for i := 2; i <= 4; i++ {
		recorded(t, mcURL, prev)
		tr, err := c.ask(t, cl, workload.Text(newRand(uint64(10*i)), 200))
		if err != nil {
			t.Fatalf("turn %d: %v", i, err)
		}
		if tr.worker != first.worker {
			t.Fatalf("turn %d went to %s, the conversation's KV cache is on %s", i, tr.worker, first.worker)
		}
		// Everything the previous turn prefilled is reused; only the
		// answer (re-tokenized) and the new message are computed.
		if tr.cached < prev.prompt || tr.cached >= tr.prompt {
			t.Fatalf("turn %d: cached %d of %d prompt tokens, want at least the previous prompt's %d",
				i, tr.cached, tr.prompt, prev.prompt)
		}
		prev = tr
	}
}

// askThenKill asks the conversation's first question and kills the worker
// that answered it.
func askThenKill(t *testing.T, f *fleet.Fleet, cl openai.Client, c *conversation) turn {
	t.Helper()
	first, err := c.ask(t, cl, "Which worker am I on?")
	if err != nil {
		t.Fatal(err)
	}
	dead := -1
	for i, w := range f.Workers {
		if w == first.worker {
			dead = i
		}
	}
	if dead < 0 {
		t.Fatalf("upstream %s is not one of the fleet's workers %v", first.worker, f.Workers)
	}
	f.KillWorker(dead)
	return first
}

// A killed worker is avoided by the standalone gateway and by Envoy with
// our endpoint picker alike: both eject it once a request could not reach
// it (the envoyhost topology retries around it: envoyhost_test.go).
func TestKilledWorkerIsAvoided(t *testing.T) {
	for _, topo := range []string{"standalone", "epp"} {
		t.Run(topo, func(t *testing.T) {
			f := startFleet(t)
			url := f.Gateway
			if topo == "epp" {
				if url = startEnvoyEPP(t, f); url == "" {
					t.Skip("no Envoy binary")
				}
			}
			killedWorkerIsAvoided(t, f, clientAt(url, 0))
		})
	}
}

func killedWorkerIsAvoided(t *testing.T, f *fleet.Fleet, cl openai.Client) {
	c := newConversation(false, 3)
	first := askThenKill(t, f, cl, c)

	// The router learns of the death from a failure: the request it sends
	// to the dead pod first may fail fast with 503 (Envoy's ORIGINAL_DST
	// cluster cannot retry on another pod; the standalone gateway does),
	// which ejects the pod. Which request that is depends on the pick: the
	// conversation's (the router still believes the dead pod holds it) or
	// a fresh one. One such 503 in all, then none, and nothing served by
	// the dead pod.
	failed := false
	ask := func(what string, c *conversation, q string) {
		t.Helper()
		tr, err := c.ask(t, cl, q)
		if err != nil {
			var apiErr *openai.Error
			if failed || !asAPIError(err, &apiErr) || apiErr.StatusCode != http.StatusServiceUnavailable {
				t.Fatalf("%s after the kill: %v", what, err)
			}
			failed = true
			if tr, err = c.ask(t, cl, q); err != nil {
				t.Fatalf("%s after the ejection: %v", what, err)
			}
		}
		if tr.worker == first.worker {
			t.Fatalf("%s was served by the killed worker %s", what, tr.worker)
		}
	}
	ask("the conversation's next turn", c, "Are you still there?")
	for i := 0; i < 4; i++ {
		ask(fmt.Sprintf("fresh request %d", i), newConversation(i%2 == 0, uint64(100+i)), "A fresh question.")
	}
}

func TestMetadataCenterOutageAndRecovery(t *testing.T) {
	f := startFleet(t)
	gws := gateways(t, f)
	f.StopMC()

	// Without the metadata center every request still succeeds: the router
	// degrades to the load this gateway sees and no cache knowledge.
	for gi, gw := range gws {
		down := newConversation(true, uint64(4+100*gi))
		for i := 0; i < 3; i++ {
			if _, err := down.ask(t, clientAt(gw.url, 0), workload.Text(newRand(uint64(40+i)), 120)); err != nil {
				t.Fatalf("%s: turn %d with the metadata center down: %v", gw.name, i, err)
			}
		}
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := f.StartMC(ctx); err != nil {
		t.Fatal(err)
	}
	// Back again (and empty): the first turn is recorded, and the following
	// ones return to the worker that holds the conversation.
	for gi, gw := range gws {
		cl := clientAt(gw.url, 0)
		up := newConversation(false, uint64(5+100*gi))
		first, err := up.ask(t, cl, "Hello again.")
		if err != nil {
			t.Fatalf("%s: %v", gw.name, err)
		}
		prev := first
		for i := 0; i < 2; i++ {
			recorded(t, f.MC, prev)
			tr, err := up.ask(t, cl, workload.Text(newRand(uint64(50+i)), 120))
			if err != nil {
				t.Fatalf("%s: %v", gw.name, err)
			}
			if tr.worker != first.worker || tr.cached == 0 {
				t.Fatalf("%s: after recovery turn %d went to %s with %d cached tokens; the conversation is on %s",
					gw.name, i+2, tr.worker, tr.cached, first.worker)
			}
			prev = tr
		}
	}
}
