package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	aoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/openai/openai-go"
	"github.com/openai/openai-go/option"
	"github.com/openai/openai-go/responses"

	"github.com/istio-llm-filter/istio-llm-filter/envoyhost"
	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/epp/envoyrun"
	oaitranscode "github.com/istio-llm-filter/istio-llm-filter/filter/transcode/openai"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// apiPod is a backend that serves the APIs our worker does not: OpenAI's
// Responses and Embeddings and Anthropic's Messages, answering each in the
// shape its API reference documents (OpenAI API reference, "Responses:
// Create a model response" → "The response object"; "Embeddings: Create
// embeddings" → "The embedding object"; Anthropic API reference,
// "Messages" → response body). It records the bodies it receives, and
// its answers name the pod so a test can tell who served.
type apiPod struct {
	name, addr string
	mu         sync.Mutex
	bodies     map[string][][]byte // path → bodies received
}

func startAPIPod(t *testing.T, name string) *apiPod {
	p := &apiPod{name: name, bodies: map[string][][]byte{}}
	ts := httptest.NewServer(http.HandlerFunc(p.serve))
	t.Cleanup(ts.Close)
	p.addr = strings.TrimPrefix(ts.URL, "http://")
	return p
}

func (p *apiPod) received(path string) [][]byte {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([][]byte(nil), p.bodies[path]...)
}

func (p *apiPod) serve(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	var req struct {
		Model string          `json:"model"`
		Input json.RawMessage `json:"input"`
	}
	if r.Method != http.MethodPost || json.Unmarshal(body, &req) != nil || req.Model == "" {
		w.WriteHeader(http.StatusBadRequest)
		fmt.Fprint(w, `{"error":{"message":"bad request","type":"invalid_request_error"}}`)
		return
	}
	p.mu.Lock()
	p.bodies[r.URL.Path] = append(p.bodies[r.URL.Path], body)
	p.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	answer := "served by " + p.name
	switch r.URL.Path {
	case "/v1/responses":
		fmt.Fprintf(w, `{"id":"resp_1","object":"response","created_at":1741476542,"status":"completed","error":null,
"incomplete_details":null,"instructions":null,"max_output_tokens":null,"model":%q,
"output":[{"type":"message","id":"msg_1","status":"completed","role":"assistant",
"content":[{"type":"output_text","text":%q,"annotations":[]}]}],
"parallel_tool_calls":true,"previous_response_id":null,"reasoning":{"effort":null,"summary":null},"store":true,
"temperature":1.0,"text":{"format":{"type":"text"}},"tool_choice":"auto","tools":[],"top_p":1.0,"truncation":"disabled",
"usage":{"input_tokens":36,"input_tokens_details":{"cached_tokens":0},"output_tokens":3,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":39},
"user":null,"metadata":{}}`, req.Model, answer)
	case "/v1/embeddings":
		fmt.Fprintf(w, `{"object":"list","data":[{"object":"embedding","embedding":[0.0023064255,-0.009327292,%d.0],"index":0}],
"model":%q,"usage":{"prompt_tokens":8,"total_tokens":8}}`, len(p.name), req.Model)
	case "/v1/messages":
		if r.Header.Get("anthropic-version") == "" {
			w.WriteHeader(http.StatusBadRequest)
			fmt.Fprint(w, `{"type":"error","error":{"type":"invalid_request_error","message":"anthropic-version header is required"}}`)
			return
		}
		fmt.Fprintf(w, `{"id":"msg_013Zva2CMHLNnXjNJJKqJ2EF","type":"message","role":"assistant","model":%q,
"content":[{"type":"text","text":%q}],"stop_reason":"end_turn","stop_sequence":null,
"usage":{"input_tokens":2095,"output_tokens":503}}`, req.Model, answer)
	default:
		w.WriteHeader(http.StatusNotFound)
		fmt.Fprint(w, `{"error":{"message":"no such path","type":"not_found"}}`)
	}
}

// hashesOf computes a body's prompt hashes as the gateway does.
func hashesOf(t *testing.T, path string, body []byte) []string {
	t.Helper()
	model, canonical, err := oaitranscode.Canonical(path, body)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return prefix.Wire(prefix.Hasher{ChunkSize: config.DefaultChunkSize}.Sum(model, canonical))
}

// cachedOn asks the metadata center which pod holds the first block of
// hashes.
func cachedOn(t *testing.T, mc, cluster string, hashes []string) string {
	body, _ := json.Marshal(api.RouteQuery{Cluster: cluster, Hashes: hashes[:1]})
	resp, err := http.Post("http://"+mc+api.PathRouteQuery, "application/json", strings.NewReader(string(body)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var ans api.RouteAnswer
	if err := json.NewDecoder(resp.Body).Decode(&ans); err != nil {
		t.Fatal(err)
	}
	for _, c := range ans.Cache {
		if c.Length > 0 {
			return c.Host
		}
	}
	return ""
}

// The official OpenAI SDK's Responses.New and Embeddings.New and the
// Anthropic SDK's Messages.New succeed through every host (the standalone
// gateway, the .so inside Envoy, and the endpoint picker behind the real
// upstream Envoy), routed by their model to its cluster: a prompt is
// hashed into the metadata center's index under the pod that served it,
// the same prompt again lands on that pod, and different tools hash
// differently.
func TestOpenAIAndAnthropicSDKsThroughEveryHost(t *testing.T) {
	bin := binaries(t)
	dir := t.TempDir()
	mc := startCmd(t, dir, "metadata-center", filepath.Join(bin, "metadata-center"), "--listen", "127.0.0.1:0", "--store", "memory")
	podA, podB := startAPIPod(t, "pod-a"), startAPIPod(t, "pod-b")
	pods := map[string]*apiPod{podA.addr: podA, podB.addr: podB}

	const cluster = "outbound|8000||apis.llm.svc.cluster.local"
	doc := fmt.Sprintf(`metadata_center: {address: "http://%s", query_timeout: 2s}
model_mapping_rule:
  gpt-oss:
    - {cluster: %q, backend: vllm}
lb_mapping_rule:
  default: {policy: cache_aware}
endpoints:
  static:
    %q: [%s, %s]
`, mc, cluster, cluster, podA.addr, podB.addr)
	cfg := filepath.Join(dir, "gateway.yaml")
	if err := os.WriteFile(cfg, []byte("listen: 127.0.0.1:0\nfilter:\n"+indent(doc)), 0o600); err != nil {
		t.Fatal(err)
	}
	gw := startCmd(t, dir, "gateway", filepath.Join(bin, "gateway"), "--config", cfg)

	exe, so := envoyArtifacts(t)
	h, err := envoyhost.Start(envoyhost.Options{HostBin: exe, SO: so, Clusters: map[string][]string{cluster: {podA.addr, podB.addr}}, DefaultCluster: cluster})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	if _, err := h.PushConfig([]byte(doc)); err != nil {
		t.Fatal(err)
	}

	hosts := []struct{ name, url string }{{"standalone", "http://" + gw}, {"envoy", h.URL()}}
	// The endpoint picker (bin/epp) on the standalone gateway's own file,
	// behind the real upstream Envoy as Istio configures an InferencePool.
	if envoyBin := envoyBinary(t); envoyBin != "" {
		eppCfg := filepath.Join(dir, "epp.yaml")
		if err := os.WriteFile(eppCfg, []byte("listen: 127.0.0.1:0\nfilter:\n"+indent(doc)), 0o600); err != nil {
			t.Fatal(err)
		}
		picker := startCmd(t, dir, "epp", filepath.Join(bin, "epp"), "--config", eppCfg)
		var elog strings.Builder
		var emu sync.Mutex
		e, err := envoyrun.Start(context.Background(), envoyrun.Options{Binary: envoyBin, EPP: picker, Retries: 2,
			Stderr: writerFunc(func(b []byte) (int, error) { emu.Lock(); defer emu.Unlock(); return elog.Write(b) })})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_ = e.Close()
			if t.Failed() {
				emu.Lock()
				t.Logf("--- upstream envoy\n%s", elog.String())
				emu.Unlock()
			}
		})
		hosts = append(hosts, struct{ name, url string }{"envoy-epp", e.URL()})
	}

	ctx := context.Background()
	for _, g := range hosts {
		t.Run(g.name, func(t *testing.T) {
			oc := openai.NewClient(option.WithBaseURL(g.url+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
			ac := anthropic.NewClient(aoption.WithBaseURL(g.url), aoption.WithAPIKey("unused"), aoption.WithMaxRetries(0))

			// sticks sends a call twice: the first lands somewhere and is
			// indexed there; the second, same prompt, lands on that pod.
			sticks := func(what, path string, call func(*http.Response) (*http.Response, string, error)) []string {
				t.Helper()
				var hr *http.Response
				hr, text, err := call(hr)
				if err != nil {
					t.Fatalf("%s: %v", what, err)
				}
				served := hr.Header.Get(headers.UpstreamHost)
				pod := pods[served]
				if pod == nil || (text != "" && text != "served by "+pod.name) {
					t.Fatalf("%s: served by %q, answer %q", what, served, text)
				}
				bodies := pod.received(path)
				hashes := hashesOf(t, path, bodies[len(bodies)-1])
				if len(hashes) == 0 {
					t.Fatalf("%s: the prompt has no hashes", what)
				}
				wait.For(t, 10*time.Second, what+": the prompt indexed under its pod", func() bool {
					return cachedOn(t, mc, cluster, hashes) == served
				})
				hr, _, err = call(hr)
				if err != nil {
					t.Fatalf("%s again: %v", what, err)
				}
				if again := hr.Header.Get(headers.UpstreamHost); again != served {
					t.Fatalf("%s again: served by %s, first by %s: no prefix affinity", what, again, served)
				}
				return hashes
			}

			for i := range 3 {
				instructions := fmt.Sprintf("You are assistant %s-%d. Answer in one short sentence.", g.name, i)
				sticks("responses", "/v1/responses", func(*http.Response) (*http.Response, string, error) {
					var hr *http.Response
					r, err := oc.Responses.New(ctx, responses.ResponseNewParams{
						Model:        "gpt-oss",
						Instructions: openai.String(instructions),
						Input:        responses.ResponseNewParamsInputUnion{OfString: openai.String("What is a KV cache?")},
					}, option.WithResponseInto(&hr))
					if err != nil {
						return nil, "", err
					}
					return hr, r.OutputText(), nil
				})
				sticks("embeddings", "/v1/embeddings", func(*http.Response) (*http.Response, string, error) {
					var hr *http.Response
					e, err := oc.Embeddings.New(ctx, openai.EmbeddingNewParams{
						Model: "gpt-oss",
						Input: openai.EmbeddingNewParamsInputUnion{OfString: openai.String(instructions)},
					}, option.WithResponseInto(&hr))
					if err != nil {
						return nil, "", err
					}
					if len(e.Data) != 1 || len(e.Data[0].Embedding) != 3 {
						return nil, "", fmt.Errorf("embeddings answer %+v", e)
					}
					return hr, "", nil
				})
			}

			// Anthropic Messages, with two tool sets: each sticks, and they
			// hash differently from the first block on.
			message := func(tool string) func(*http.Response) (*http.Response, string, error) {
				return func(*http.Response) (*http.Response, string, error) {
					var hr *http.Response
					m, err := ac.Messages.New(ctx, anthropic.MessageNewParams{
						Model:     "gpt-oss",
						MaxTokens: 64,
						System:    []anthropic.TextBlockParam{{Text: "You are a weather bot of " + g.name + "."}},
						Tools:     []anthropic.ToolUnionParam{anthropic.ToolUnionParamOfTool(anthropic.ToolInputSchemaParam{Properties: map[string]any{"city": map[string]any{"type": "string"}}}, tool)},
						Messages:  []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Weather in Paris?"))},
					}, aoption.WithResponseInto(&hr))
					if err != nil {
						return nil, "", err
					}
					if len(m.Content) != 1 {
						return nil, "", fmt.Errorf("message content %+v", m.Content)
					}
					return hr, m.Content[0].Text, nil
				}
			}
			weather := sticks("messages with get_weather", "/v1/messages", message("get_weather"))
			forecast := sticks("messages with get_forecast", "/v1/messages", message("get_forecast"))
			if weather[0] == forecast[0] {
				t.Fatalf("different tools share the first block hash %s", weather[0])
			}
		})
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(b []byte) (int, error) { return f(b) }
