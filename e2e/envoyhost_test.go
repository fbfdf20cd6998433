package e2e

import (
	"fmt"
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
	"github.com/istio-llm-filter/istio-llm-filter/envoyhost"
)

var (
	hostOnce        sync.Once
	hostBin, hostSO string
	hostErr         error
)

// gateway is one way into the fleet: the standalone gateway, the real
// llm-filter.so inside the Envoy-faithful host (envoyhost/), or the real
// upstream Envoy with our endpoint picker (filter/epp).
type gateway struct {
	name string
	url  string
}

// gateways returns every way into f; the envoy and epp ones share f's
// workers and metadata center, with the same filter document as the
// standalone one.
func gateways(t *testing.T, f *fleet.Fleet) []gateway {
	gws := []gateway{{"standalone", f.Gateway}, {"envoy", startEnvoy(t, f)}}
	if url := startEnvoyEPP(t, f); url != "" {
		gws = append(gws, gateway{"epp", url})
	}
	return gws
}

// envoyArtifacts builds bin/envoyhost and bin/llm-filter.so once per test
// binary.
func envoyArtifacts(t *testing.T) (bin, so string) {
	t.Helper()
	hostOnce.Do(func() {
		root, err := exec.Command("go", "env", "GOMOD").Output()
		if err != nil {
			hostErr = err
			return
		}
		hostBin, hostSO, hostErr = envoyhost.Build(filepath.Dir(strings.TrimSpace(string(root))))
	})
	if hostErr != nil {
		t.Fatal(hostErr)
	}
	return hostBin, hostSO
}

func startEnvoy(t *testing.T, f *fleet.Fleet) string {
	t.Helper()
	bin, so := envoyArtifacts(t)
	logf, err := os.Create(filepath.Join(f.LogDir, "envoyhost.log"))
	if err != nil {
		t.Fatal(err)
	}
	h, err := envoyhost.Start(envoyhost.Options{
		HostBin: bin, SO: so, Concurrency: 2, LogLevel: 3,
		Clusters:       map[string][]string{fleet.Cluster: f.Workers},
		DefaultCluster: fleet.Cluster,
		Retries:        2, // Istio's default route retry policy (connect-failure, previous_hosts)
		Stderr:         logf,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := h.Close(); err != nil {
			t.Errorf("envoyhost: %v", err)
		}
		logf.Close()
	})
	doc := fmt.Sprintf(`protocol: openai
metadata_center: {address: %s}
model_mapping_rule:
  tiny:
    - {cluster: %q, backend: llamacpp}
lb_mapping_rule:
  default: {policy: cache_aware}
endpoints:
  static:
    %q: [%s]
`, f.MC, fleet.Cluster, fleet.Cluster, strings.Join(f.Workers, ", "))
	if _, err := h.PushConfig([]byte(doc)); err != nil {
		t.Fatal(err)
	}
	return h.URL()
}

func clientAt(url string, retries int) openai.Client {
	return openai.NewClient(
		option.WithBaseURL(url+"/v1/"),
		option.WithAPIKey("unused"),
		option.WithMaxRetries(retries),
		option.WithRequestTimeout(2*time.Minute),
	)
}

// Through Envoy a killed pod is retried around (connect failure, another
// host) and the filter names the pod that really answered.
func TestKilledWorkerIsAvoidedThroughEnvoy(t *testing.T) {
	f := startFleet(t)
	cl := clientAt(startEnvoy(t, f), 0)
	c := newConversation(false, 6)
	first := askThenKill(t, f, cl, c)
	for i := 0; i < 3; i++ {
		tr, err := c.ask(t, cl, fmt.Sprintf("Are you still there? (%d)", i))
		if err != nil {
			t.Fatalf("turn %d after the kill: %v", i, err)
		}
		if tr.worker == first.worker {
			t.Fatalf("turn %d reported the killed worker %s", i, tr.worker)
		}
	}
	for i := 0; i < 4; i++ {
		other := newConversation(i%2 == 0, uint64(200+i))
		tr, err := other.ask(t, cl, "A fresh question.")
		if err != nil {
			t.Fatalf("request %d after the kill: %v", i, err)
		}
		if tr.worker == first.worker {
			t.Fatalf("request %d reported the killed worker", i)
		}
	}
}
