package e2e

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/envoyhost"
	"github.com/istio-llm-filter/istio-llm-filter/internal/headers"
)

// Text logs (msg=... addr=...) and the metadata center's JSON ("msg":...,"addr":...).
var readyAddr = regexp.MustCompile(`msg"?[=:]"?([a-z ]+ready|gateway listening|metadata center listening|endpoint picker listening)"?.*[ ,"]addr"?[=:]"?([0-9.:]+)`)

// startCmd runs a program until the test ends and returns the addr of its
// first "... ready" / "gateway listening" / "endpoint picker listening" log line.
func startCmd(t *testing.T, logDir, name, path string, args ...string) string {
	t.Helper()
	cmd := exec.Command(path, args...)
	cmd.Env = os.Environ()
	logf, err := os.Create(filepath.Join(logDir, name+".log"))
	if err != nil {
		t.Fatal(err)
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout = logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	addr := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		sent := false
		for sc.Scan() {
			fmt.Fprintln(logf, sc.Text())
			if m := readyAddr.FindStringSubmatch(sc.Text()); m != nil && !sent {
				addr <- m[2]
				sent = true
			}
		}
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		logf.Close()
		if t.Failed() {
			b, _ := os.ReadFile(logf.Name())
			if len(b) > 3000 {
				b = b[len(b)-3000:]
			}
			t.Logf("--- %s (tail)\n%s", name, b)
		}
	})
	select {
	case a := <-addr:
		return a
	case <-time.After(3 * time.Minute):
		t.Fatalf("%s never became ready", name)
	}
	return ""
}

type chatAnswer struct {
	status int
	served string
	text   string
	errTyp string
	trace  string
}

func chatAt(t *testing.T, url, body string) chatAnswer {
	t.Helper()
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var out struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
		Error struct {
			Type string `json:"type"`
		} `json:"error"`
		TraceID string `json:"trace_id"`
	}
	if err := json.Unmarshal(raw, &out); err != nil {
		t.Fatalf("answer %d is not JSON: %s", resp.StatusCode, raw)
	}
	a := chatAnswer{status: resp.StatusCode, served: resp.Header.Get(headers.UpstreamHost), errTyp: out.Error.Type, trace: out.TraceID}
	if len(out.Choices) == 1 {
		a.text = out.Choices[0].Message.Content
	}
	return a
}

// LoRA routing through both hosts, with real llama.cpp compute: a base pod
// and an adapter pod (worker --lora, adapter from mkmodel --lora-out) in one
// cluster, the adapter pod labelled lora=support in the static list. A
// request naming the adapter lands on the adapter pod and gets the adapted
// output; a base request never goes there; an adapter no pod has is 404.
func TestLoRARequestsLandOnTheAdapterPod(t *testing.T) {
	if testing.Short() {
		t.Skip("starts llama.cpp workers")
	}
	bin := binaries(t)
	dir := t.TempDir()
	model, adapter := filepath.Join(dir, "tiny.gguf"), filepath.Join(dir, "support.gguf")
	if out, err := exec.Command(filepath.Join(bin, "mkmodel"), "--out", model, "--lora-out", adapter).CombinedOutput(); err != nil {
		t.Fatalf("mkmodel: %v\n%s", err, out)
	}
	common := []string{"--model", model, "--model-name", "tiny", "--listen", "127.0.0.1:0", "--threads", "1", "--n-ctx", "2048", "--n-seq-max", "4"}
	base := startCmd(t, dir, "worker-base", filepath.Join(bin, "worker"), common...)
	adapted := startCmd(t, dir, "worker-lora", filepath.Join(bin, "worker"), append(common, "--lora", "support="+adapter)...)

	const msgs = `"messages":[{"role":"user","content":"Tell me about KV caches."}],"max_tokens":16,"ignore_eos":true,"temperature":0`
	baseBody, loraBody := `{"model":"tiny",`+msgs+`}`, `{"model":"tiny","lora":"support",`+msgs+`}`
	// What each pod answers when asked directly.
	wantBase, wantLoRA := chatAt(t, "http://"+base, baseBody), chatAt(t, "http://"+adapted, loraBody)
	if wantBase.status != 200 || wantLoRA.status != 200 || wantBase.text == wantLoRA.text {
		t.Fatalf("direct answers: base %d %q, adapter %d %q: the adapter must change the output", wantBase.status, wantBase.text, wantLoRA.status, wantLoRA.text)
	}

	doc := fmt.Sprintf(`model_mapping_rule:
  tiny:
    - {cluster: pool, backend: llamacpp}
lb_mapping_rule:
  default: {policy: round_robin}
endpoints:
  static:
    pool:
      - %s
      - {address: %q, labels: {lora: support}}
`, base, adapted)
	cfg := filepath.Join(dir, "gateway.yaml")
	if err := os.WriteFile(cfg, []byte("listen: 127.0.0.1:0\nfilter:\n"+indent(doc)), 0o600); err != nil {
		t.Fatal(err)
	}
	gw := startCmd(t, dir, "gateway", filepath.Join(bin, "gateway"), "--config", cfg)

	exe, so := envoyArtifacts(t)
	h, err := envoyhost.Start(envoyhost.Options{HostBin: exe, SO: so, Clusters: map[string][]string{"pool": {base, adapted}}, DefaultCluster: "pool"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	if _, err := h.PushConfig([]byte(doc)); err != nil {
		t.Fatal(err)
	}

	for _, g := range []struct{ name, url string }{{"standalone", "http://" + gw}, {"envoy", h.URL()}} {
		t.Run(g.name, func(t *testing.T) {
			for i := 0; i < 3; i++ { // round robin would reach both pods
				if a := chatAt(t, g.url, loraBody); a.status != 200 || a.served != adapted || a.text != wantLoRA.text {
					t.Fatalf("lora request %d: %d served by %q (adapter pod %s): %q, want %q", i, a.status, a.served, adapted, a.text, wantLoRA.text)
				}
				if a := chatAt(t, g.url, baseBody); a.status != 200 || a.served != base || a.text != wantBase.text {
					t.Fatalf("base request %d: %d served by %q (base pod %s): %q, want %q", i, a.status, a.served, base, a.text, wantBase.text)
				}
			}
			a := chatAt(t, g.url, `{"model":"tiny","lora":"legal",`+msgs+`}`)
			if a.status != 404 || a.errTyp != "not_found" || a.trace == "" || a.served != "" {
				t.Fatalf("unknown adapter: %+v, want 404 not_found with a trace id, from the gateway", a)
			}
		})
	}
}

func indent(s string) string {
	var b strings.Builder
	for _, l := range strings.Split(strings.TrimRight(s, "\n"), "\n") {
		b.WriteString("  " + l + "\n")
	}
	return b.String()
}
