package e2e

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/envoyhost"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

// freeAddr reserves a loopback port for a worker that must advertise its
// address before it listens.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// Labels and adapters that workers register with a real metadata center
// route requests through both hosts, although neither endpoint source (the
// standalone gateway's static list, the Envoy host's cluster) labels the
// pods: a base pod started with --label pool=bronze and an adapter pod with
// --lora support=... --label pool=gold. A request naming the adapter gets
// the adapter pod's output, a label selector and a rule's selector find
// their pod, base requests never reach the adapter pod, and an adapter no
// pod has is 404 in the error format.
func TestRegisteredLabelsRouteThroughBothHosts(t *testing.T) {
	if testing.Short() {
		t.Skip("starts llama.cpp workers")
	}
	bin := binaries(t)
	dir := t.TempDir()
	model, adapter := filepath.Join(dir, "tiny.gguf"), filepath.Join(dir, "support.gguf")
	if out, err := exec.Command(filepath.Join(bin, "mkmodel"), "--out", model, "--lora-out", adapter).CombinedOutput(); err != nil {
		t.Fatalf("mkmodel: %v\n%s", err, out)
	}
	mc := startCmd(t, dir, "metadata-center", filepath.Join(bin, "metadata-center"), "--listen", "127.0.0.1:0", "--store", "memory")
	const cluster = "pool"
	common := []string{"--model", model, "--model-name", "tiny", "--threads", "1", "--n-ctx", "2048", "--n-seq-max", "4",
		"--metadata-center", "http://" + mc, "--cluster", cluster}
	baseAddr, loraAddr := freeAddr(t), freeAddr(t)
	base := startCmd(t, dir, "worker-base", filepath.Join(bin, "worker"), append(common, "--listen", baseAddr, "--label", "pool=bronze")...)
	adapted := startCmd(t, dir, "worker-lora", filepath.Join(bin, "worker"),
		append(common, "--listen", loraAddr, "--lora", "support="+adapter, "--label", "pool=gold")...)

	const msgs = `"messages":[{"role":"user","content":"Tell me about KV caches."}],"max_tokens":16,"ignore_eos":true,"temperature":0`
	baseBody, loraBody := `{"model":"tiny",`+msgs+`}`, `{"model":"tiny","lora":"support",`+msgs+`}`
	wantBase, wantLoRA := chatAt(t, "http://"+base, baseBody), chatAt(t, "http://"+adapted, loraBody)
	if wantBase.status != 200 || wantLoRA.status != 200 || wantBase.text == wantLoRA.text {
		t.Fatalf("direct answers: base %d %q, adapter %d %q: the adapter must change the output", wantBase.status, wantBase.text, wantLoRA.status, wantLoRA.text)
	}

	// Neither source labels the pods: only their registrations do.
	doc := fmt.Sprintf(`metadata_center: {address: "http://%s", query_timeout: 2s}
model_mapping_rule:
  tiny:
    - {cluster: %s, backend: llamacpp}
  tiny-bronze:
    - {cluster: %s, backend: llamacpp, selector: {pool: bronze}}
lb_mapping_rule:
  default: {policy: cache_aware}
endpoints:
  static:
    %s: [%s, %s]
`, mc, cluster, cluster, cluster, base, adapted)
	cfg := filepath.Join(dir, "gateway.yaml")
	if err := os.WriteFile(cfg, []byte("listen: 127.0.0.1:0\nfilter:\n"+indent(doc)), 0o600); err != nil {
		t.Fatal(err)
	}
	gw := startCmd(t, dir, "gateway", filepath.Join(bin, "gateway"), "--config", cfg)

	exe, so := envoyArtifacts(t)
	h, err := envoyhost.Start(envoyhost.Options{HostBin: exe, SO: so, Clusters: map[string][]string{cluster: {base, adapted}}, DefaultCluster: cluster})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Close() })
	if _, err := h.PushConfig([]byte(doc)); err != nil {
		t.Fatal(err)
	}

	// In the mesh the filter reads the pods from Envoy's admin /clusters,
	// which carries no labels at all.
	admin := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/clusters" || r.URL.Query().Get("format") != "json" {
			http.NotFound(w, r)
			return
		}
		type sock struct {
			Address   string `json:"address"`
			PortValue int    `json:"port_value"`
		}
		type hs struct {
			Address      map[string]sock   `json:"address"`
			HealthStatus map[string]string `json:"health_status"`
		}
		var hosts []hs
		for _, a := range []string{base, adapted} {
			ip, port, _ := net.SplitHostPort(a)
			p, _ := strconv.Atoi(port)
			hosts = append(hosts, hs{Address: map[string]sock{"socket_address": {ip, p}}, HealthStatus: map[string]string{"eds_health_status": "HEALTHY"}})
		}
		_ = json.NewEncoder(w).Encode(map[string]any{"cluster_statuses": []any{map[string]any{"name": cluster, "host_statuses": hosts}}})
	}))
	t.Cleanup(admin.Close)
	adminDoc := strings.Replace(doc, fmt.Sprintf("  static:\n    %s: [%s, %s]\n", cluster, base, adapted),
		fmt.Sprintf("  envoy_admin: {address: %q, refresh: 100ms}\n", admin.URL), 1)
	if adminDoc == doc {
		t.Fatal("the envoy_admin config was not made")
	}

	for _, g := range []struct{ name, url, push string }{{"standalone", "http://" + gw, ""}, {"envoy", h.URL(), ""}, {"envoy_admin", h.URL(), adminDoc}} {
		t.Run(g.name, func(t *testing.T) {
			if g.push != "" {
				if _, err := h.PushConfig([]byte(g.push)); err != nil {
					t.Fatal(err)
				}
			}
			// The workers register with their first signal report; the
			// first request may come before that.
			var first chatAnswer
			if !wait.Until(30*time.Second, func() bool { first = chatAt(t, g.url, loraBody); return first.status == 200 }) {
				t.Fatalf("lora request never routed: %+v", first)
			}
			for i := 0; i < 3; i++ {
				if a := chatAt(t, g.url, loraBody); a.status != 200 || a.served != adapted || a.text != wantLoRA.text {
					t.Fatalf("lora request %d: %d served by %q (adapter pod %s): %q, want %q", i, a.status, a.served, adapted, a.text, wantLoRA.text)
				}
				if a := chatAt(t, g.url, baseBody); a.status != 200 || a.served != base || a.text != wantBase.text {
					t.Fatalf("base request %d: %d served by %q (base pod %s): %q, want %q", i, a.status, a.served, base, a.text, wantBase.text)
				}
				if a := chatAt(t, g.url, `{"model":"tiny","label_selector":{"pool":"gold"},"lora":"support",`+msgs+`}`); a.status != 200 || a.served != adapted {
					t.Fatalf("label_selector pool=gold with the adapter %d: %+v, want the adapter pod %s", i, a, adapted)
				}
				if a := chatAt(t, g.url, `{"model":"tiny-bronze",`+msgs+`}`); a.status != 200 || a.served != base {
					t.Fatalf("rule selector pool=bronze %d: %+v, want the base pod %s", i, a, base)
				}
			}
			a := chatAt(t, g.url, `{"model":"tiny","lora":"legal",`+msgs+`}`)
			if a.status != 404 || a.errTyp != "not_found" || a.trace == "" || a.served != "" {
				t.Fatalf("unknown adapter: %+v, want 404 not_found with a trace id, from the gateway", a)
			}
			a = chatAt(t, g.url, `{"model":"tiny","label_selector":{"pool":"silver"},`+msgs+`}`)
			if a.status != 404 || a.errTyp != "not_found" {
				t.Fatalf("a label no pod registered: %+v, want 404 not_found", a)
			}

			// The model list: the configured models, then the adapters
			// registered pods serve, with their base model as parent.
			var list struct {
				Object string
				Data   []struct{ ID, Object, Parent string }
			}
			if code := getJSON(t, g.url+"/v1/models", &list); code != 200 || list.Object != "list" {
				t.Fatalf("GET /v1/models: %d %+v", code, list)
			}
			got := fmt.Sprint(list.Data)
			if want := "[{tiny model } {tiny-bronze model } {support model tiny}]"; got != want {
				t.Fatalf("GET /v1/models data %s, want %s", got, want)
			}
			var one struct{ ID, Object, Parent string }
			if code := getJSON(t, g.url+"/v1/models/support", &one); code != 200 || one.ID != "support" || one.Parent != "tiny" {
				t.Fatalf("GET /v1/models/support: %d %+v", code, one)
			}
			var e struct {
				Error   struct{ Type string }
				TraceID string `json:"trace_id"`
			}
			if code := getJSON(t, g.url+"/v1/models/legal", &e); code != 404 || e.Error.Type != "not_found" || e.TraceID == "" {
				t.Fatalf("GET /v1/models/legal: %d %+v, want 404 not_found with a trace id", code, e)
			}
		})
	}
}

func getJSON(t *testing.T, url string, out any) int {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(out); err != nil {
		t.Fatalf("GET %s: %d, body not JSON: %v", url, resp.StatusCode, err)
	}
	return resp.StatusCode
}
