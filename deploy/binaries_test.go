package deploy_test

// The manifests' container args are only right if the real programs accept
// them. This test builds the metadata center, the worker and mkmodel, runs
// them with the args and environment of the built Deployments (resolving
// $(VAR) references the way the kubelet does), overriding only what a test
// cannot have (listen addresses, the Redis and metadata-center addresses,
// the model directory), and checks that they come up and talk to each other.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/cgoenv"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

var varRef = regexp.MustCompile(`\$\(([A-Za-z_][A-Za-z0-9_]*)\)`)

// expand resolves $(VAR) like the kubelet: unknown variables stay as written.
func expand(s string, env map[string]string) string {
	return varRef.ReplaceAllStringFunc(s, func(ref string) string {
		if v, ok := env[ref[2:len(ref)-1]]; ok {
			return v
		}
		return ref
	})
}

// containerEnv resolves a container's env from the built stack. Optional
// Secret references resolve to nothing (no Secret is shipped); fieldRefs come
// from fields.
func containerEnv(t *testing.T, s stack, ns string, c corev1.Container, fields map[string]string) map[string]string {
	t.Helper()
	env := map[string]string{}
	for _, e := range c.Env {
		switch {
		case e.ValueFrom == nil:
			env[e.Name] = expand(e.Value, env)
		case e.ValueFrom.ConfigMapKeyRef != nil:
			ref := e.ValueFrom.ConfigMapKeyRef
			cm := must[*corev1.ConfigMap](t, s, ns, ref.Name)
			v, ok := cm.Data[ref.Key]
			if !ok {
				t.Fatalf("env %s: ConfigMap %s has no key %s", e.Name, ref.Name, ref.Key)
			}
			env[e.Name] = v
		case e.ValueFrom.SecretKeyRef != nil:
			if ref := e.ValueFrom.SecretKeyRef; ref.Optional == nil || !*ref.Optional {
				t.Fatalf("env %s: required Secret %s is not part of the deployment", e.Name, ref.Name)
			}
		case e.ValueFrom.FieldRef != nil:
			v, ok := fields[e.ValueFrom.FieldRef.FieldPath]
			if !ok {
				t.Fatalf("env %s: no test value for field %s", e.Name, e.ValueFrom.FieldRef.FieldPath)
			}
			env[e.Name] = v
		default:
			t.Fatalf("env %s: unsupported source %+v", e.Name, e.ValueFrom)
		}
	}
	return env
}

// commandLine is a container's args with $(VAR) resolved, then rewritten by
// the test's overrides: flags named in set replace the manifest's value (the
// position is kept), and path prefixes in mounts are mapped to directories.
func commandLine(c corev1.Container, env map[string]string, set map[string]string, mounts map[string]string) []string {
	var out []string
	seen := map[string]bool{}
	for _, a := range c.Args {
		a = expand(a, env)
		if name, _, ok := strings.Cut(strings.TrimPrefix(a, "--"), "="); ok && strings.HasPrefix(a, "--") {
			if v, ok := set[name]; ok {
				a, seen[name] = "--"+name+"="+v, true
			}
		}
		for from, to := range mounts {
			a = strings.Replace(a, "="+from+"/", "="+to+"/", 1)
		}
		out = append(out, a)
	}
	for name, v := range set {
		if !seen[name] {
			out = append(out, "--"+name+"="+v)
		}
	}
	return out
}

var (
	textMsg  = regexp.MustCompile(`(?:^|\s)msg=(?:"((?:[^"\\]|\\.)*)"|(\S+))`)
	textAddr = regexp.MustCompile(`(?:^|\s)addr=(?:"([^"]*)"|(\S+))`)
)

// parseLogLine reads msg and addr from a log/slog record in JSON or text
// form (the programs differ); other lines give nil.
func parseLogLine(line string) map[string]any {
	var m map[string]any
	if json.Unmarshal([]byte(line), &m) == nil {
		return m
	}
	mm := textMsg.FindStringSubmatch(line)
	if mm == nil {
		return nil
	}
	m = map[string]any{"msg": mm[1] + mm[2]}
	if am := textAddr.FindStringSubmatch(line); am != nil {
		m["addr"] = am[1] + am[2]
	}
	return m
}

// proc is a started program whose log records are watched.
type proc struct {
	cmd  *exec.Cmd
	mu   sync.Mutex
	log  strings.Builder
	msgs chan map[string]any
}

func startProc(t *testing.T, path string, args []string, env map[string]string) *proc {
	t.Helper()
	cmd := exec.Command(path, args...)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir()}
	for k, v := range env {
		cmd.Env = append(cmd.Env, k+"="+v)
	}
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout = io.Discard
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &proc{cmd: cmd, msgs: make(chan map[string]any, 256)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			p.mu.Lock()
			p.log.WriteString(line + "\n")
			p.mu.Unlock()
			if m := parseLogLine(line); m != nil {
				select {
				case p.msgs <- m:
				default:
				}
			}
		}
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		exited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(exited) }()
		select {
		case <-exited:
		case <-time.After(15 * time.Second):
			_ = cmd.Process.Kill()
			<-exited
		}
		<-done
	})
	return p
}

func (p *proc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.log.String()
}

// await returns the "addr" of the first log record whose msg is want.
func (p *proc) await(t *testing.T, want string, within time.Duration) string {
	t.Helper()
	deadline := time.After(within)
	for {
		select {
		case m := <-p.msgs:
			if m["msg"] == want {
				addr, _ := m["addr"].(string)
				return addr
			}
		case <-deadline:
			t.Fatalf("no %q log record within %v; output:\n%s", want, within, p.output())
		}
	}
}

func httpGet(t *testing.T, url string, bearer ...string) (int, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, tok := range bearer {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp.StatusCode, string(b)
}

func probePath(t *testing.T, p *corev1.Probe) string {
	t.Helper()
	if p == nil || p.HTTPGet == nil {
		t.Fatal("probe is not an HTTP GET")
	}
	return p.HTTPGet.Path
}

func goBuild(t *testing.T, dir string, pkgs ...string) {
	t.Helper()
	cmd := exec.Command("go", append([]string{"build", "-o", dir + "/"}, pkgs...)...)
	cmd.Dir = ".."
	cmd.Env = cgoenv.Environ()
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build %v: %v\n%s", pkgs, err, out)
	}
}

func TestManifestArgsRunTheRealBinaries(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs the metadata center, mkmodel and the worker")
	}
	s := build(t, ".")
	bin := t.TempDir()
	goBuild(t, bin, "./metadata-center/cmd/metadata-center", "./worker/cmd/worker", "./worker/cmd/mkmodel")
	redis := redistest.Shared(t)

	// Metadata center, on the test's Redis with a private key prefix.
	mcDep := must[*appsv1.Deployment](t, s, "llm", "metadata-center")
	mcC := container(t, mcDep.Spec.Template.Spec, "metadata-center")
	mcEnv := containerEnv(t, s, "llm", mcC, nil)
	if mcEnv["LLMF_REDIS_ADDR"] == "" {
		t.Fatal("LLMF_REDIS_ADDR did not resolve from the ConfigMap")
	}
	mcEnv["LLMF_REDIS_ADDR"] = redis.Addr
	// The Secret metadata-center-auth, as kubelet mounts it for the
	// metadata center and the worker.
	const token = "deploy-test-token"
	auth := t.TempDir()
	if err := os.WriteFile(filepath.Join(auth, "token"), []byte(token+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	const authMount = "/etc/llm-filter/mc-auth"
	mc := startProc(t, filepath.Join(bin, "metadata-center"),
		commandLine(mcC, mcEnv, map[string]string{"listen": "127.0.0.1:0", "redis-key-prefix": redis.Prefix}, map[string]string{authMount: auth}), mcEnv)
	mcAddr := mc.await(t, "metadata center listening", 30*time.Second)
	for _, probe := range []*corev1.Probe{mcC.LivenessProbe, mcC.ReadinessProbe, mcC.StartupProbe} {
		if code, body := httpGet(t, "http://"+mcAddr+probePath(t, probe)); code != http.StatusOK {
			t.Fatalf("metadata center %s = %d %s\n%s", probe.HTTPGet.Path, code, body, mc.output())
		}
	}

	// The worker Deployment: its init container writes the model, then the
	// worker serves it and reports to the metadata center.
	wDep := must[*appsv1.Deployment](t, s, "llm", "worker-tiny")
	spec := wDep.Spec.Template.Spec
	models, podinfo := t.TempDir(), t.TempDir()
	mounts := map[string]string{"/models": models, "/etc/podinfo": podinfo, authMount: auth}
	// The downward API volume, as the kubelet writes it: the pod's labels,
	// key="value" per line.
	var labelsFile strings.Builder
	for k, v := range wDep.Spec.Template.Labels {
		fmt.Fprintf(&labelsFile, "%s=%q\n", k, v)
	}
	if err := os.WriteFile(filepath.Join(podinfo, "labels"), []byte(labelsFile.String()), 0o644); err != nil {
		t.Fatal(err)
	}
	if len(spec.InitContainers) != 1 {
		t.Fatalf("want one init container, got %d", len(spec.InitContainers))
	}
	ic := spec.InitContainers[0]
	if len(ic.Command) != 1 || !strings.HasPrefix(ic.Command[0], "/usr/local/bin/") {
		t.Fatalf("init container command %v: want one binary from the image", ic.Command)
	}
	init := exec.Command(filepath.Join(bin, filepath.Base(ic.Command[0])), commandLine(ic, nil, nil, mounts)...)
	if out, err := init.CombinedOutput(); err != nil {
		t.Fatalf("init container %v: %v\n%s", init.Args, err, out)
	}

	wC := container(t, spec, "worker")
	wEnv := containerEnv(t, s, "llm", wC, map[string]string{"status.podIP": "127.0.0.1"})
	w := startProc(t, filepath.Join(bin, "worker"),
		commandLine(wC, wEnv, map[string]string{"listen": "127.0.0.1:0", "metadata-center": "http://" + mcAddr}, mounts), wEnv)
	wAddr := w.await(t, "worker ready", 3*time.Minute)
	for _, probe := range []*corev1.Probe{wC.LivenessProbe, wC.ReadinessProbe, wC.StartupProbe} {
		// Polled as the kubelet does: readiness waits for the metadata
		// center's acknowledgement of the start-up index reset.
		var code int
		var body string
		if !wait.Until(10*time.Second, func() bool {
			code, body = httpGet(t, "http://"+wAddr+probePath(t, probe))
			return code == http.StatusOK
		}) {
			t.Fatalf("worker %s = %d %s\n%s", probe.HTTPGet.Path, code, body, w.output())
		}
	}
	if code, body := httpGet(t, "http://"+wAddr+wDep.Spec.Template.Annotations["prometheus.io/path"]); code != http.StatusOK || !strings.Contains(body, "llmf_worker_") {
		t.Errorf("worker scrape path: %d, llmf_worker_ series present: %v", code, strings.Contains(body, "llmf_worker_"))
	}

	// The model name the rules are keyed by is served; in the shared pool
	// any other name is refused in the error format, never answered.
	chat := func(model string) (int, map[string]any) {
		t.Helper()
		body := `{"model":"` + model + `","messages":[{"role":"user","content":"hello"}],"max_tokens":4}`
		resp, err := http.Post("http://"+wAddr+"/v1/chat/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var out map[string]any
		if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
			t.Fatalf("model %q: %d, body not JSON: %v", model, resp.StatusCode, err)
		}
		return resp.StatusCode, out
	}
	model, _ := flagValue(wC.Args, "model-name")
	if code, out := chat(model); code != http.StatusOK || out["choices"] == nil {
		t.Errorf("chat with model %q: %d %v", model, code, out)
	}
	if code, out := chat(model + "-other"); code != http.StatusNotFound || out["error"] == nil {
		t.Errorf("chat with another model: %d %v, want 404 with an error object", code, out)
	}

	// A starting worker tells the metadata center to forget its address
	// ({all: true} eviction), under the manifest's --cluster: seeing that call
	// succeed proves the worker found the metadata center and was accepted.
	evictOK := regexp.MustCompile(`llmf_metadata_center_requests_total\{[^}]*code="200"[^}]*endpoint="/v1/cache/evict"[^}]*\} [1-9]`)
	if !wait.Until(30*time.Second, func() bool {
		_, metrics := httpGet(t, "http://"+mcAddr+mcDep.Spec.Template.Annotations["prometheus.io/path"])
		return evictOK.MatchString(metrics)
	}) {
		t.Fatalf("the worker's start-up eviction never reached the metadata center\nworker:\n%s\nmetadata center:\n%s", w.output(), mc.output())
	}

	// The worker registered the pod's labels (from the downward API file)
	// under the manifest's --cluster, so the router's selectors see them.
	cluster, _ := flagValue(wC.Args, "cluster")
	if code, _ := httpGet(t, "http://"+mcAddr+"/v1/pods?cluster="+url.QueryEscape(cluster)); code != http.StatusUnauthorized {
		t.Fatalf("without the token from the mounted Secret: %d, want 401", code)
	}
	var body string
	if !wait.Until(30*time.Second, func() bool {
		_, body = httpGet(t, "http://"+mcAddr+"/v1/pods?cluster="+url.QueryEscape(cluster), token)
		var pods map[string]struct {
			Labels map[string]string `json:"labels"`
			Models []string          `json:"models"`
		}
		_ = json.Unmarshal([]byte(body), &pods)
		// Under its advertised address ($(POD_IP):8000), not the test's port.
		p, ok := pods["127.0.0.1:8000"]
		return ok && reflect.DeepEqual(p.Labels, wDep.Spec.Template.Labels) && len(p.Models) == 1 && p.Models[0] == model
	}) {
		t.Fatalf("the worker's registration never reached the metadata center: %s\nworker:\n%s", body, w.output())
	}
}
