// Tests of what an operator applies: every manifest under deploy/ and istio/
// decodes strictly into its typed object, `kustomize build` succeeds for every
// kustomization (run in process, as `kubectl apply -k` does), the built stack
// is wired together the way the filter needs it, and the Dockerfiles are
// pinned and agree with the manifests.
package deploy_test

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	meshconfig "istio.io/api/mesh/v1alpha1"
	networkingv1 "istio.io/client-go/pkg/apis/networking/v1"
	networkingv1alpha3 "istio.io/client-go/pkg/apis/networking/v1alpha3"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	netv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"

	"github.com/istio-llm-filter/istio-llm-filter/deploy/manifesttest"
	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
)

// roots holds every manifest the project ships, relative to this directory.
var roots = []string{".", "../istio"}

func TestEveryManifestDecodesStrictly(t *testing.T) {
	files, err := manifesttest.YAMLFiles(roots...)
	if err != nil {
		t.Fatal(err)
	}
	patches, err := manifesttest.PatchFiles(roots...)
	if err != nil {
		t.Fatal(err)
	}
	data, err := manifesttest.GeneratorFiles(roots...)
	if err != nil {
		t.Fatal(err)
	}
	var n int
	for _, f := range files {
		if data[filepath.Clean(f)] {
			continue // a ConfigMap's data (TestEndpointPickerInstall reads it)
		}
		if strings.HasPrefix(filepath.ToSlash(f), "helm/") {
			continue // templates, not objects: helm_test.go checks what they render
		}
		docs, err := manifesttest.ReadDocuments(f)
		if err != nil {
			t.Fatal(err)
		}
		if len(docs) == 0 {
			t.Errorf("%s: no documents", f)
		}
		for _, d := range docs {
			n++
			decode := manifesttest.Decode
			if patches[filepath.Clean(f)] {
				decode = manifesttest.DecodePatch
			}
			if _, err := decode(d.YAML); err != nil {
				t.Errorf("%s: %v", d, err)
			}
		}
	}
	// A walk that silently found nothing would pass vacuously.
	if len(files) < 10 || n < 20 {
		t.Fatalf("only %d files / %d documents found under %v", len(files), n, roots)
	}
	t.Logf("%d documents in %d files decoded strictly", n, len(files))
}

// stack is the decoded output of one kustomize build.
type stack struct {
	objs []any
}

func build(t *testing.T, dir string) stack {
	t.Helper()
	rendered, err := manifesttest.BuildDecoded(dir)
	if err != nil {
		t.Fatal(err)
	}
	var s stack
	for _, r := range rendered {
		s.objs = append(s.objs, r.Object)
	}
	return s
}

func find[T any](s stack, namespace, name string) (T, bool) {
	for _, o := range s.objs {
		if v, ok := o.(T); ok {
			m := any(v).(interface {
				GetName() string
				GetNamespace() string
			})
			if m.GetName() == name && m.GetNamespace() == namespace {
				return v, true
			}
		}
	}
	var zero T
	return zero, false
}

func all[T any](s stack) []T {
	var out []T
	for _, o := range s.objs {
		if v, ok := o.(T); ok {
			out = append(out, v)
		}
	}
	return out
}

func must[T any](t *testing.T, s stack, namespace, name string) T {
	t.Helper()
	v, ok := find[T](s, namespace, name)
	if !ok {
		var zero T
		t.Fatalf("no %T %s/%s in the build", zero, namespace, name)
	}
	return v
}

func TestEveryKustomizationBuilds(t *testing.T) {
	for _, dir := range []string{".", "base", "gateway", "inferencepool", "overlays/external-redis", "overlays/model-pvc", "overlays/metadata-center-tls", "overlays/monitoring", "../istio"} {
		t.Run(dir, func(t *testing.T) {
			if s := build(t, dir); len(s.objs) == 0 {
				t.Fatal("empty build")
			}
		})
	}
}

func container(t *testing.T, spec corev1.PodSpec, name string) corev1.Container {
	t.Helper()
	for _, c := range spec.Containers {
		if c.Name == name {
			return c
		}
	}
	t.Fatalf("no container %q", name)
	return corev1.Container{}
}

func flagValue(args []string, name string) (string, bool) {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v, true
		}
	}
	return "", false
}

func TestMetadataCenterDeployment(t *testing.T) {
	s := build(t, ".")
	d := must[*appsv1.Deployment](t, s, "llm", "metadata-center")
	if d.Spec.Replicas == nil || *d.Spec.Replicas != 2 {
		t.Errorf("replicas = %v, want 2", d.Spec.Replicas)
	}
	c := container(t, d.Spec.Template.Spec, "metadata-center")
	if c.LivenessProbe == nil || c.LivenessProbe.HTTPGet == nil || c.LivenessProbe.HTTPGet.Path != "/healthz" {
		t.Errorf("liveness probe = %+v, want GET /healthz", c.LivenessProbe)
	}
	if c.ReadinessProbe == nil || c.ReadinessProbe.HTTPGet == nil || c.ReadinessProbe.HTTPGet.Path != "/readyz" {
		t.Errorf("readiness probe = %+v, want GET /readyz", c.ReadinessProbe)
	}
	if c.Resources.Requests.Cpu().IsZero() || c.Resources.Limits.Memory().IsZero() {
		t.Errorf("resources not set: %+v", c.Resources)
	}
	if v, _ := flagValue(c.Args, "store"); v != "redis" {
		t.Errorf("--store = %q, want redis (two replicas must share state)", v)
	}
	if v, _ := flagValue(c.Args, "listen"); v != "0.0.0.0:8080" {
		t.Errorf("--listen = %q", v)
	}

	env := map[string]corev1.EnvVar{}
	for _, e := range c.Env {
		env[e.Name] = e
	}
	// --redis-addr=$(LLMF_REDIS_ADDR) must resolve to the generated ConfigMap
	// (name with hash suffix, rewritten by kustomize) pointing at the Redis Service.
	if v, _ := flagValue(c.Args, "redis-addr"); v != "$(LLMF_REDIS_ADDR)" {
		t.Errorf("--redis-addr = %q", v)
	}
	ref := env["LLMF_REDIS_ADDR"].ValueFrom
	if ref == nil || ref.ConfigMapKeyRef == nil {
		t.Fatalf("LLMF_REDIS_ADDR not from a ConfigMap: %+v", ref)
	}
	cm := must[*corev1.ConfigMap](t, s, "llm", ref.ConfigMapKeyRef.Name)
	addr := cm.Data[ref.ConfigMapKeyRef.Key]
	rsvc := must[*corev1.Service](t, s, "llm", "redis")
	if want := fmt.Sprintf("redis.llm.svc.cluster.local:%d", rsvc.Spec.Ports[0].Port); addr != want {
		t.Errorf("redis address %q, want %q", addr, want)
	}
	redis := must[*appsv1.StatefulSet](t, s, "llm", "redis")
	np := must[*netv1.NetworkPolicy](t, s, "llm", "redis")
	if !selects(t, np.Spec.PodSelector.MatchLabels, redis.Spec.Template.Labels) {
		t.Error("the Redis NetworkPolicy does not select the Redis pods")
	}
	if len(np.Spec.Ingress) != 1 || len(np.Spec.Ingress[0].From) != 1 ||
		!selects(t, np.Spec.Ingress[0].From[0].PodSelector.MatchLabels, d.Spec.Template.Labels) {
		t.Errorf("the Redis NetworkPolicy does not admit exactly the metadata center: %+v", np.Spec.Ingress)
	}

	pdb := must[*policyv1.PodDisruptionBudget](t, s, "llm", "metadata-center")
	if !selects(t, pdb.Spec.Selector.MatchLabels, d.Spec.Template.Labels) {
		t.Errorf("PDB selector %v does not select the pods %v", pdb.Spec.Selector.MatchLabels, d.Spec.Template.Labels)
	}
	svc := must[*corev1.Service](t, s, "llm", "metadata-center")
	if !selects(t, svc.Spec.Selector, d.Spec.Template.Labels) {
		t.Errorf("Service selector %v does not select the pods", svc.Spec.Selector)
	}
}

func selects(t *testing.T, selector, podLabels map[string]string) bool {
	t.Helper()
	if len(selector) == 0 {
		return false
	}
	return labels.SelectorFromSet(selector).Matches(labels.Set(podLabels))
}

func TestExternalRedisOverlay(t *testing.T) {
	s := build(t, "overlays/external-redis")
	if _, ok := find[*appsv1.StatefulSet](s, "llm", "redis"); ok {
		t.Error("in-cluster Redis StatefulSet still present")
	}
	if _, ok := find[*corev1.Service](s, "llm", "redis"); ok {
		t.Error("in-cluster Redis Service still present")
	}
	if _, ok := find[*netv1.NetworkPolicy](s, "llm", "redis"); ok {
		t.Error("in-cluster Redis NetworkPolicy still present")
	}
	d := must[*appsv1.Deployment](t, s, "llm", "metadata-center")
	var ref *corev1.ConfigMapKeySelector
	for _, e := range container(t, d.Spec.Template.Spec, "metadata-center").Env {
		if e.Name == "LLMF_REDIS_ADDR" {
			ref = e.ValueFrom.ConfigMapKeyRef
		}
	}
	if ref == nil {
		t.Fatal("LLMF_REDIS_ADDR gone")
	}
	cm := must[*corev1.ConfigMap](t, s, "llm", ref.Name)
	if got := cm.Data[ref.Key]; got != "redis.example.internal:6379" {
		t.Errorf("redis address %q, want the component's external address", got)
	}
}

// Operators write their own overlay picking components; both must apply
// together.
func TestComponentsCombine(t *testing.T) {
	overlay := t.TempDir()
	rel := func(p string) string {
		abs, err := filepath.Abs(p)
		if err != nil {
			t.Fatal(err)
		}
		r, err := filepath.Rel(overlay, abs)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	k := fmt.Sprintf("apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - %s\n  - %s\n  - %s\ncomponents:\n  - %s\n  - %s\n  - %s\n  - %s\n",
		rel("base"), rel("gateway"), rel("../istio"), rel("components/external-redis"), rel("components/model-pvc"), rel("components/metadata-center-tls"), rel("components/monitoring"))
	if err := os.WriteFile(filepath.Join(overlay, "kustomization.yaml"), []byte(k), 0o644); err != nil {
		t.Fatal(err)
	}
	s := build(t, overlay)
	if _, ok := find[*appsv1.StatefulSet](s, "llm", "redis"); ok {
		t.Error("external-redis did not apply")
	}
	d := must[*appsv1.Deployment](t, s, "llm", "worker-tiny")
	if len(d.Spec.Template.Spec.InitContainers) != 0 {
		t.Error("model-pvc did not apply")
	}
	if v, _ := flagValue(container(t, d.Spec.Template.Spec, "worker").Args, "metadata-center-ca-file"); v == "" {
		t.Error("metadata-center-tls did not apply")
	}
	if _, ok := find[*manifesttest.PodMonitor](s, "llm", "llm-worker"); !ok {
		t.Error("monitoring did not apply")
	}
}

// Each PodMonitor selects the pods of one Deployment in its namespace and
// scrapes what their prometheus.io annotations name: a named port of the
// pod (the gateway's Envoy port is Istio's, injected into the pod).
func TestPodMonitorsScrapeTheAnnotatedEndpoints(t *testing.T) {
	checkPodMonitors(t, build(t, "overlays/monitoring"))
}

// checkPodMonitors checks every PodMonitor of the stack against the pods it
// selects; there must be three (gateway or picker, metadata center, workers).
func checkPodMonitors(t *testing.T, s stack) {
	t.Helper()
	istioPorts := map[string]int32{"http-envoy-prom": 15090} // Istio's gateway injection template
	monitors := 0
	for _, o := range s.objs {
		pm, ok := o.(*manifesttest.PodMonitor)
		if !ok {
			continue
		}
		monitors++
		sel, err := metav1.LabelSelectorAsSelector(&pm.Spec.Selector)
		if err != nil || sel.Empty() {
			t.Fatalf("PodMonitor %s: selector %v: %v", pm.Name, pm.Spec.Selector, err)
		}
		var pods []*appsv1.Deployment
		for _, o := range s.objs {
			if d, ok := o.(*appsv1.Deployment); ok && d.Namespace == pm.Namespace && sel.Matches(labels.Set(d.Spec.Template.Labels)) {
				pods = append(pods, d)
			}
		}
		if len(pods) == 0 {
			t.Errorf("PodMonitor %s/%s selects no Deployment's pods", pm.Namespace, pm.Name)
		}
		if len(pm.Spec.PodMetricsEndpoints) != 1 {
			t.Fatalf("PodMonitor %s: %d endpoints, want 1", pm.Name, len(pm.Spec.PodMetricsEndpoints))
		}
		ep := pm.Spec.PodMetricsEndpoints[0]
		if ep.Port == nil {
			t.Fatalf("PodMonitor %s: no port name", pm.Name)
		}
		for _, d := range pods {
			a := d.Spec.Template.Annotations
			port, ok := istioPorts[*ep.Port]
			if !ok {
				for _, c := range d.Spec.Template.Spec.Containers {
					for _, p := range c.Ports {
						if p.Name == *ep.Port {
							port, ok = p.ContainerPort, true
						}
					}
				}
			}
			if !ok {
				t.Errorf("PodMonitor %s: pods of %s have no port %q", pm.Name, d.Name, *ep.Port)
				continue
			}
			// The annotations name the same path; their port is the
			// container's, or Istio's merged one (15020) at the gateway.
			if a["prometheus.io/path"] != ep.Path {
				t.Errorf("PodMonitor %s scrapes %s, %s's annotations %s", pm.Name, ep.Path, d.Name, a["prometheus.io/path"])
			}
			if want := a["prometheus.io/port"]; want != fmt.Sprint(port) && !(want == "15020" && port == 15090) {
				t.Errorf("PodMonitor %s scrapes port %d, %s's annotations %s", pm.Name, port, d.Name, want)
			}
		}
	}
	if monitors != 3 {
		t.Errorf("%d PodMonitors, want 3 (gateway or endpoint picker, metadata center, workers)", monitors)
	}
}

func TestModelPVCOverlay(t *testing.T) { checkModelPVC(t, build(t, "overlays/model-pvc")) }

func checkModelPVC(t *testing.T, s stack) {
	t.Helper()
	d := must[*appsv1.Deployment](t, s, "llm", "worker-tiny")
	spec := d.Spec.Template.Spec
	if len(spec.InitContainers) != 0 {
		t.Errorf("init containers left: %v", spec.InitContainers)
	}
	var claim string
	for _, v := range spec.Volumes {
		if v.Name == "models" && v.PersistentVolumeClaim != nil && v.EmptyDir == nil {
			claim = v.PersistentVolumeClaim.ClaimName
		}
	}
	pvc := must[*corev1.PersistentVolumeClaim](t, s, "llm", claim)
	if len(pvc.Spec.AccessModes) == 0 {
		t.Error("claim without access modes")
	}
	if v, _ := flagValue(container(t, spec, "worker").Args, "model"); v != "/models/model.gguf" {
		t.Errorf("--model=%q", v)
	}
	checkWorkerPod(t, d)
}

// clusterName is how Istio names the outbound cluster of a Service port.
func clusterName(host string, port uint32) string {
	return fmt.Sprintf("outbound|%d||%s", port, host)
}

var clusterRE = regexp.MustCompile(`^outbound\|(\d+)\|\|([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local$`)

// filterDoc is the part of the built EnvoyFilter's filter document these
// checks compare with the worker manifests.
type filterDoc struct {
	MetadataCenter struct {
		Address       string `json:"address"`
		AuthToken     string `json:"auth_token"`
		AuthTokenFile string `json:"auth_token_file"`
		TLS           struct {
			CAFile string `json:"ca_file"`
		} `json:"tls"`
	} `json:"metadata_center"`
	ModelMappingRule map[string][]struct {
		Cluster string `json:"cluster"`
	} `json:"model_mapping_rule"`
	PromptHash struct {
		ChunkSize int `json:"chunk_size"`
	} `json:"prompt_hash"`
}

// pluginDoc digs the filter document out of the built EnvoyFilter.
func pluginDoc(t *testing.T, s stack) filterDoc {
	t.Helper()
	ef := must[*networkingv1alpha3.EnvoyFilter](t, s, "istio-ingress", "llm-filter")
	for _, p := range ef.Spec.ConfigPatches {
		if p.GetApplyTo().String() != "HTTP_FILTER" {
			continue
		}
		js, err := p.GetPatch().GetValue().MarshalJSON()
		if err != nil {
			t.Fatal(err)
		}
		var v struct {
			TypedConfig struct {
				PluginConfig struct {
					Value filterDoc `json:"value"`
				} `json:"plugin_config"`
			} `json:"typed_config"`
		}
		if err := json.Unmarshal(js, &v); err != nil {
			t.Fatal(err)
		}
		doc := v.TypedConfig.PluginConfig.Value
		if doc.PromptHash.ChunkSize == 0 {
			doc.PromptHash.ChunkSize = config.DefaultChunkSize
		}
		return doc
	}
	t.Fatal("no HTTP_FILTER patch")
	return filterDoc{}
}

// The override host only works if the pinned pod is a host of the cluster
// the route chose, and the worker reports evictions under the names the
// filter uses. This walks every rule of the built stack and checks the chain:
// rule cluster -> Service -> worker pods -> worker flags, and that the
// catch-all route's pool contains those pods.
func TestRoutingChainIsConsistent(t *testing.T) { checkRoutingChain(t, build(t, ".")) }

func checkRoutingChain(t *testing.T, s stack) {
	t.Helper()
	doc := pluginDoc(t, s)
	rules := doc.ModelMappingRule
	if len(rules) == 0 {
		t.Fatal("no model_mapping_rule in the built EnvoyFilter")
	}

	vs := must[*networkingv1.VirtualService](t, s, "llm", "llm-api")
	checkVirtualServicePaths(t, vs)
	routed := map[string]bool{}
	var catchAll string
	for _, r := range vs.Spec.Http {
		// Envoy ignores the override host on retries: only a refused
		// connection (nothing sent) may go to another pod of the cluster.
		if r.Retries == nil || r.Retries.Attempts != 1 || r.Retries.RetryOn != "connect-failure" {
			t.Errorf("route %q: retries %+v; want attempts 1 on connect-failure only (docs/operations.md, \"Override host, retries and strict mode\")", r.Name, r.Retries)
		}
		for _, dst := range r.Route {
			routed[clusterName(dst.Destination.Host, dst.Destination.Port.GetNumber())] = true
		}
		for _, m := range r.Match {
			if m.GetUri().GetPrefix() == "/v1/" && len(m.Headers) == 0 {
				catchAll = r.Route[0].Destination.Host
			}
		}
	}
	if catchAll == "" {
		t.Fatal("no catch-all /v1/ route")
	}
	pm := strings.SplitN(catchAll, ".", 3)
	pool := must[*corev1.Service](t, s, pm[1], pm[0])

	deployments := all[*appsv1.Deployment](s)
	for model, rs := range rules {
		for _, r := range rs {
			m := clusterRE.FindStringSubmatch(r.Cluster)
			if m == nil {
				t.Errorf("model %s: cluster %q is not an Istio outbound cluster name", model, r.Cluster)
				continue
			}
			port, name, ns := m[1], m[2], m[3]
			if !routed[r.Cluster] {
				t.Errorf("model %s: cluster %s is not a destination of any VirtualService route", model, r.Cluster)
			}
			svc := must[*corev1.Service](t, s, ns, name)
			var sp *corev1.ServicePort
			for i := range svc.Spec.Ports {
				if fmt.Sprint(svc.Spec.Ports[i].Port) == port {
					sp = &svc.Spec.Ports[i]
				}
			}
			if sp == nil {
				t.Errorf("Service %s/%s has no port %s", ns, name, port)
				continue
			}
			var pods int
			for _, d := range deployments {
				if d.Namespace != ns || !selects(t, svc.Spec.Selector, d.Spec.Template.Labels) {
					continue
				}
				pods++
				if !selects(t, pool.Spec.Selector, d.Spec.Template.Labels) {
					t.Errorf("%s's pods are not in the catch-all pool %s: Envoy would not find the pinned host", d.Name, pool.Name)
				}
				c := container(t, d.Spec.Template.Spec, "worker")
				target := containerPort(t, c, sp.TargetPort)
				if fmt.Sprint(target) != port {
					t.Errorf("%s: Service port %s targets container port %d; EDS hosts use the container port, keep them equal", d.Name, port, target)
				}
				if v, _ := flagValue(c.Args, "cluster"); v != r.Cluster {
					t.Errorf("%s: --cluster=%q, want the rule's %q", d.Name, v, r.Cluster)
				}
				if v, _ := flagValue(c.Args, "advertise-host"); v != "$(POD_IP):"+port {
					t.Errorf("%s: --advertise-host=%q, want $(POD_IP):%s (the EDS address)", d.Name, v, port)
				}
				if v, _ := flagValue(c.Args, "strict-model-name"); v != "true" {
					t.Errorf("%s: --strict-model-name=%q; in the shared pool a pod must refuse other models", d.Name, v)
				}
				if v, _ := flagValue(c.Args, "model-name"); v != model {
					t.Errorf("%s: --model-name=%q, but the rule is for model %q", d.Name, v, model)
				}
				if v, _ := flagValue(c.Args, "prompt-hash-chunk-size"); v != fmt.Sprint(doc.PromptHash.ChunkSize) {
					t.Errorf("%s: --prompt-hash-chunk-size=%q, the filter hashes in %d-byte blocks", d.Name, v, doc.PromptHash.ChunkSize)
				}
				checkWorkerPod(t, d)
			}
			if pods == 0 {
				t.Errorf("Service %s/%s selects no worker Deployment", ns, name)
			}
		}
	}
}

func containerPort(t *testing.T, c corev1.Container, target intstr.IntOrString) int32 {
	t.Helper()
	if target.Type == intstr.Int {
		return target.IntVal
	}
	for _, p := range c.Ports {
		if p.Name == target.StrVal {
			return p.ContainerPort
		}
	}
	t.Fatalf("container %s has no port named %q", c.Name, target.StrVal)
	return 0
}

func checkWorkerPod(t *testing.T, d *appsv1.Deployment) {
	t.Helper()
	spec := d.Spec.Template.Spec
	c := container(t, spec, "worker")
	if c.ReadinessProbe == nil || c.ReadinessProbe.HTTPGet == nil || c.ReadinessProbe.HTTPGet.Path != "/readyz" {
		t.Errorf("%s: readiness probe %+v, want GET /readyz", d.Name, c.ReadinessProbe)
	}
	if c.LivenessProbe == nil || c.LivenessProbe.HTTPGet == nil {
		t.Errorf("%s: no liveness probe", d.Name)
	}
	if c.Resources.Requests.Cpu().IsZero() || c.Resources.Limits.Memory().IsZero() {
		t.Errorf("%s: resources not set", d.Name)
	}
	checkWorkerDrain(t, d.Name, spec, c)
	ann := d.Spec.Template.Annotations
	if ann["prometheus.io/scrape"] != "true" || ann["prometheus.io/path"] != "/metrics" {
		t.Errorf("%s: Prometheus scrape annotations missing: %v", d.Name, ann)
	}
	model, ok := flagValue(c.Args, "model")
	if !ok {
		t.Fatalf("%s: no --model", d.Name)
	}
	// The model file must be on a mounted volume, and the volume must exist.
	var mounted bool
	for _, m := range c.VolumeMounts {
		if strings.HasPrefix(model, m.MountPath+"/") && slices.ContainsFunc(spec.Volumes, func(v corev1.Volume) bool { return v.Name == m.Name }) {
			mounted = true
		}
	}
	if !mounted {
		t.Errorf("%s: --model=%s is not on a mounted volume", d.Name, model)
	}
	if e, _ := flagValue(c.Args, "engine"); e != "llama" && e != "sim" {
		t.Errorf("%s: --engine=%q", d.Name, e)
	}
}

// checkWorkerDrain checks that a worker pod drains before the kubelet
// kills it: its preStop pause, then --drain-timeout (the worker's default,
// 100s, when unset), both within terminationGracePeriodSeconds.
func checkWorkerDrain(t *testing.T, name string, spec corev1.PodSpec, c corev1.Container) {
	t.Helper()
	if spec.TerminationGracePeriodSeconds == nil {
		t.Errorf("%s: no terminationGracePeriodSeconds", name)
		return
	}
	grace := time.Duration(*spec.TerminationGracePeriodSeconds) * time.Second
	drain := 100 * time.Second
	if v, ok := flagValue(c.Args, "drain-timeout"); ok {
		var err error
		if drain, err = time.ParseDuration(v); err != nil {
			t.Errorf("%s: --drain-timeout=%s: %v", name, v, err)
		}
	}
	var pause time.Duration
	switch h := c.Lifecycle; {
	case h == nil || h.PreStop == nil:
		t.Errorf("%s: no preStop hook: the endpoint may still get requests after SIGTERM", name)
	case h.PreStop.Sleep != nil:
		pause = time.Duration(h.PreStop.Sleep.Seconds) * time.Second
	case h.PreStop.Exec != nil && len(h.PreStop.Exec.Command) == 2 && strings.HasSuffix(h.PreStop.Exec.Command[0], "sleep"):
		n, err := strconv.Atoi(h.PreStop.Exec.Command[1])
		if err != nil {
			t.Errorf("%s: preStop %v", name, h.PreStop.Exec.Command)
		}
		pause = time.Duration(n) * time.Second
	default:
		t.Errorf("%s: preStop %+v, want a pause (sleep)", name, h.PreStop)
	}
	if pause+drain >= grace || drain < 30*time.Second {
		t.Errorf("%s: preStop %v + --drain-timeout %v, want at least 30s of drain and below the grace period %v", name, pause, drain, grace)
	}
}

// proxy.istio.io/config is a ProxyConfig in YAML inside an annotation: the
// API server cannot check it, and istiod only logs what it cannot read.
func TestProxyConfigAnnotationsAreValid(t *testing.T) {
	// The gateway's and the workers'.
	checkProxyConfigs(t, build(t, "."), 2)
}

// checkProxyConfigs checks every proxy.istio.io/config of the stack; at
// least min Deployments must carry one.
func checkProxyConfigs(t *testing.T, s stack, min int) {
	t.Helper()
	var n int
	for _, d := range all[*appsv1.Deployment](s) {
		blob, ok := d.Spec.Template.Annotations["proxy.istio.io/config"]
		if !ok {
			continue
		}
		n++
		js, err := yaml.YAMLToJSONStrict([]byte(blob))
		if err != nil {
			t.Errorf("%s: %v", d.Name, err)
			continue
		}
		var pc meshconfig.ProxyConfig
		if err := protojson.Unmarshal(js, &pc); err != nil {
			t.Errorf("%s: proxy.istio.io/config: %v", d.Name, err)
			continue
		}
		// Envoy must not cut streams before the pod's grace period ends, nor
		// outlive it (the kubelet would kill it mid-drain).
		grace := time.Duration(*d.Spec.Template.Spec.TerminationGracePeriodSeconds) * time.Second
		if drain := pc.GetTerminationDrainDuration().AsDuration(); drain < 30*time.Second || drain >= grace {
			t.Errorf("%s: terminationDrainDuration %v, want ≥30s and below the grace period %v", d.Name, drain, grace)
		}
	}
	if n < min {
		t.Fatalf("%d Deployments carry proxy.istio.io/config, want %d", n, min)
	}
}

func TestGatewayDeploymentRunsTheFilterImage(t *testing.T) {
	checkGatewayRunsFilterImage(t, build(t, "."), "istio-llm-filter/gateway:")
}

// checkGatewayRunsFilterImage checks the EnvoyFilter's gateway: its proxy
// image (whose reference starts with image), and that the EnvoyFilter selects
// exactly its pods.
func checkGatewayRunsFilterImage(t *testing.T, s stack, image string) {
	t.Helper()
	d := must[*appsv1.Deployment](t, s, "istio-ingress", "llm-gateway")
	tpl := d.Spec.Template
	if tpl.Labels["istio"] != "ingressgateway" {
		t.Errorf("gateway pods lack istio: ingressgateway (the EnvoyFilter's selector): %v", tpl.Labels)
	}
	if tpl.Annotations["inject.istio.io/templates"] != "gateway" || container(t, tpl.Spec, "istio-proxy").Image != "auto" {
		t.Error("gateway is not deployed by gateway injection (image auto + gateway template)")
	}
	img := tpl.Annotations["sidecar.istio.io/proxyImage"]
	if !strings.HasPrefix(img, image) {
		t.Errorf("proxy image %q is not the filter's gateway image", img)
	}
	gw := must[*networkingv1.Gateway](t, s, "istio-ingress", "llm-gateway")
	if !selects(t, gw.Spec.Selector, tpl.Labels) {
		t.Errorf("Gateway selector %v does not select the gateway pods", gw.Spec.Selector)
	}
	ef := must[*networkingv1alpha3.EnvoyFilter](t, s, "istio-ingress", "llm-filter")
	if !selects(t, ef.Spec.GetWorkloadSelector().GetLabels(), tpl.Labels) {
		t.Error("EnvoyFilter does not select the gateway pods")
	}
	// Every pod the EnvoyFilter selects must carry the .so: in its namespace
	// (the only one it applies to, outside the root namespace) no other
	// Deployment may match.
	for _, other := range all[*appsv1.Deployment](s) {
		if other.Namespace == ef.Namespace && other.Name != d.Name && selects(t, ef.Spec.GetWorkloadSelector().GetLabels(), other.Spec.Template.Labels) {
			t.Errorf("EnvoyFilter also selects %s, which has no .so", other.Name)
		}
	}
}

// dockerfile is the part of a Dockerfile these checks read.
type dockerfile struct {
	froms  []string // image references, in order
	copies []string // COPY lines of the final stage
	users  []string // USER of the final stage
}

func readDockerfile(t *testing.T, path string) dockerfile {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var df dockerfile
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 || strings.HasPrefix(fields[0], "#") {
			continue
		}
		switch strings.ToUpper(fields[0]) {
		case "FROM":
			df.froms = append(df.froms, fields[1])
			df.copies, df.users = nil, nil
		case "COPY":
			df.copies = append(df.copies, strings.Join(fields[1:], " "))
		case "USER":
			df.users = append(df.users, fields[1])
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return df
}

var pinnedRE = regexp.MustCompile(`^[a-z0-9./-]+(:[A-Za-z0-9._-]*[0-9][A-Za-z0-9._-]*)?(@sha256:[0-9a-f]{64})?$`)

func TestDockerfilesArePinnedMultiStageNonRoot(t *testing.T) {
	goVersion := goDirective(t)
	for _, name := range []string{"metadata-center", "worker", "gateway", "epp"} {
		t.Run(name, func(t *testing.T) {
			df := readDockerfile(t, filepath.Join("images", name+".Dockerfile"))
			if len(df.froms) < 2 {
				t.Fatalf("FROM lines %v: want a multi-stage build", df.froms)
			}
			for _, ref := range df.froms {
				if !pinnedRE.MatchString(ref) || !(strings.Contains(ref, ":") || strings.Contains(ref, "@sha256:")) {
					t.Errorf("FROM %s is not pinned to a version or digest", ref)
				}
				if img, ok := strings.CutPrefix(ref, "golang:"); ok && !strings.HasPrefix(img, goVersion) {
					t.Errorf("builder %s does not match go.mod's go %s", ref, goVersion)
				}
			}
			if len(df.users) == 0 {
				t.Fatal("final stage sets no USER")
			}
			u := df.users[len(df.users)-1]
			if u == "root" || u == "0" || strings.HasPrefix(u, "0:") || strings.HasPrefix(u, "root:") {
				t.Errorf("final stage runs as %s", u)
			}
		})
	}
}

// goDirective is go.mod's "go 1.N[.P]" reduced to "1.N".
func goDirective(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^go (\d+\.\d+)`).FindSubmatch(b)
	if m == nil {
		t.Fatal("no go directive in go.mod")
	}
	return string(m[1])
}

// envoySDK is the minor release of the Envoy Go SDK in go.mod ("1.36").
func envoySDK(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../go.mod")
	if err != nil {
		t.Fatal(err)
	}
	m := regexp.MustCompile(`(?m)^\s*github\.com/envoyproxy/envoy v(\d+\.\d+)\.\d+`).FindSubmatch(b)
	if m == nil {
		t.Fatal("github.com/envoyproxy/envoy not required in go.mod")
	}
	return string(m[1])
}

// istioForEnvoy pairs Envoy minor releases with the Istio minor release whose
// proxyv2 ships them (Istio's supported-releases table; 1.28 pulls Envoy's
// release/v1.36 branch). Extend it when bumping the SDK.
var istioForEnvoy = map[string]string{
	"1.34": "1.26",
	"1.35": "1.27",
	"1.36": "1.28",
}

func TestGatewayImagePairsSDKWithIstioAndShipsTheLibrary(t *testing.T) {
	df := readDockerfile(t, filepath.Join("images", "gateway.Dockerfile"))
	final := df.froms[len(df.froms)-1]
	tag, ok := strings.CutPrefix(final, "istio/proxyv2:")
	if !ok {
		t.Fatalf("final stage FROM %s, want istio/proxyv2:<version>", final)
	}
	sdk := envoySDK(t)
	istio, ok := istioForEnvoy[sdk]
	if !ok {
		t.Fatalf("no known Istio release for Envoy SDK %s: add the pairing", sdk)
	}
	if !strings.HasPrefix(tag, istio+".") {
		t.Errorf("proxyv2:%s does not ship Envoy %s (needs Istio %s.x)", tag, sdk, istio)
	}

	s := build(t, "../istio")
	ef := must[*networkingv1alpha3.EnvoyFilter](t, s, "istio-ingress", "llm-filter")
	var libPath string
	for _, p := range ef.Spec.ConfigPatches {
		if tc := p.GetPatch().GetValue().GetFields()["typed_config"]; tc != nil {
			libPath = tc.GetStructValue().GetFields()["library_path"].GetStringValue()
		}
	}
	if libPath == "" {
		t.Fatal("EnvoyFilter has no library_path")
	}
	var shipped bool
	for _, c := range df.copies {
		f := strings.Fields(c)
		if len(f) >= 2 && f[len(f)-1] == libPath && strings.HasSuffix(f[len(f)-2], ".so") {
			shipped = true
		}
	}
	if !shipped {
		t.Errorf("gateway image does not COPY a .so to the EnvoyFilter's library_path %s (final stage COPYs: %v)", libPath, df.copies)
	}
}

// secretFile checks that path, a file a container reads, lies in a volume
// of Secret secret, key key, mounted into the container.
func secretFile(t *testing.T, what string, spec corev1.PodSpec, c corev1.Container, path, secret, key string) {
	t.Helper()
	for _, m := range c.VolumeMounts {
		rel, ok := strings.CutPrefix(path, strings.TrimSuffix(m.MountPath, "/")+"/")
		if !ok {
			continue
		}
		for _, v := range spec.Volumes {
			if v.Name != m.Name {
				continue
			}
			if v.Secret == nil || v.Secret.SecretName != secret {
				t.Errorf("%s: %s is in volume %s, not in Secret %s", what, path, v.Name, secret)
				return
			}
			if m.SubPath != "" {
				// A subPath mount is never updated: the Secret could not rotate.
				t.Errorf("%s: %s is mounted with subPath, which kubelet never updates", what, path)
			}
			if rel != key && !slices.ContainsFunc(v.Secret.Items, func(i corev1.KeyToPath) bool { return i.Key == key && i.Path == rel }) {
				t.Errorf("%s: %s is not where Secret %s's key %s lands", what, path, secret, key)
			}
			return
		}
		t.Errorf("%s: volume %s mounted at %s does not exist", what, m.Name, m.MountPath)
		return
	}
	t.Errorf("%s: %s is on no mounted volume", what, path)
}

// The metadata center, the workers and the gateway's filter all read the
// bearer token from the Secret metadata-center-auth mounted as a volume
// (so it rotates without a restart); the EnvoyFilter carries only the path.
func TestAuthTokenIsAMountedSecret(t *testing.T) {
	s := build(t, ".")
	checkAuthToken(t, s)
	checkSecretsOptional(t, s)
}

// checkAuthToken checks the token's Secret mounts; the gateway's when the
// stack has the EnvoyFilter.
func checkAuthToken(t *testing.T, s stack) {
	t.Helper()
	mc := must[*appsv1.Deployment](t, s, "llm", "metadata-center")
	mcC := container(t, mc.Spec.Template.Spec, "metadata-center")
	path, ok := flagValue(mcC.Args, "auth-token-file")
	if !ok {
		t.Fatal("the metadata center has no --auth-token-file")
	}
	secretFile(t, "metadata center", mc.Spec.Template.Spec, mcC, path, "metadata-center-auth", "token")

	for _, d := range all[*appsv1.Deployment](s) {
		spec := d.Spec.Template.Spec
		for _, c := range spec.Containers {
			if _, ok := flagValue(c.Args, "metadata-center"); !ok {
				continue
			}
			if _, inline := flagValue(c.Args, "metadata-center-token"); inline {
				t.Errorf("%s: the token is inline (--metadata-center-token), not a mounted Secret", d.Name)
			}
			path, ok := flagValue(c.Args, "metadata-center-token-file")
			if !ok {
				t.Errorf("%s: no --metadata-center-token-file", d.Name)
				continue
			}
			secretFile(t, d.Name, spec, c, path, "metadata-center-auth", "token")
		}
	}

	if _, ok := find[*networkingv1alpha3.EnvoyFilter](s, "istio-ingress", "llm-filter"); !ok {
		return
	}
	doc := pluginDoc(t, s)
	if doc.MetadataCenter.AuthToken != "" {
		t.Error("the EnvoyFilter carries the token itself (metadata_center.auth_token)")
	}
	if doc.MetadataCenter.AuthTokenFile == "" {
		t.Fatal("the EnvoyFilter has no metadata_center.auth_token_file")
	}
	gw := must[*appsv1.Deployment](t, s, "istio-ingress", "llm-gateway")
	secretFile(t, "gateway", gw.Spec.Template.Spec, container(t, gw.Spec.Template.Spec, "istio-proxy"),
		doc.MetadataCenter.AuthTokenFile, "metadata-center-auth", "token")
}

// checkSecretsOptional checks that no pod of the stack waits for a Secret:
// none is shipped, so the stack must come up before the operator adds them.
func checkSecretsOptional(t *testing.T, s stack) {
	t.Helper()
	for _, d := range all[*appsv1.Deployment](s) {
		for _, v := range d.Spec.Template.Spec.Volumes {
			if v.Secret != nil && (v.Secret.Optional == nil || !*v.Secret.Optional) {
				t.Errorf("%s: Secret %s is required but no Secret is shipped", d.Name, v.Secret.SecretName)
			}
		}
	}
}

// The metadata-center-tls overlay serves the metadata center over HTTPS from
// the Secret metadata-center-tls, and its clients verify it: the workers
// against that Secret's ca.crt alone, the gateway's filter against the CA
// Secret of its own namespace; the filter document still parses.
func TestMetadataCenterTLSOverlay(t *testing.T) {
	checkMetadataCenterTLS(t, build(t, "overlays/metadata-center-tls"))
}

// checkMetadataCenterTLS checks the metadata center's HTTPS and its clients'
// CA; the gateway's filter when the stack has the EnvoyFilter.
func checkMetadataCenterTLS(t *testing.T, s stack) {
	t.Helper()
	mc := must[*appsv1.Deployment](t, s, "llm", "metadata-center")
	spec := mc.Spec.Template.Spec
	c := container(t, spec, "metadata-center")
	for flag, key := range map[string]string{"tls-cert-file": "tls.crt", "tls-key-file": "tls.key"} {
		path, ok := flagValue(c.Args, flag)
		if !ok {
			t.Fatalf("the metadata center has no --%s", flag)
		}
		secretFile(t, "metadata center", spec, c, path, "metadata-center-tls", key)
	}
	for _, p := range []*corev1.Probe{c.StartupProbe, c.LivenessProbe, c.ReadinessProbe} {
		if p == nil || p.HTTPGet == nil || p.HTTPGet.Scheme != corev1.URISchemeHTTPS {
			t.Errorf("probe %+v does not use HTTPS", p)
		}
	}
	if mc.Spec.Template.Annotations["prometheus.io/scheme"] != "https" {
		t.Error("Prometheus would scrape the metadata center in plain HTTP")
	}

	w := must[*appsv1.Deployment](t, s, "llm", "worker-tiny")
	wc := container(t, w.Spec.Template.Spec, "worker")
	var urls []string
	for _, a := range wc.Args {
		if v, ok := strings.CutPrefix(a, "--metadata-center="); ok {
			urls = append(urls, v)
		}
	}
	if len(urls) != 1 || !strings.HasPrefix(urls[0], "https://") {
		t.Errorf("worker --metadata-center %v, want one https:// URL", urls)
	}
	ca, ok := flagValue(wc.Args, "metadata-center-ca-file")
	if !ok {
		t.Fatal("the worker has no --metadata-center-ca-file")
	}
	secretFile(t, "worker", w.Spec.Template.Spec, wc, ca, "metadata-center-tls", "ca.crt")
	for _, v := range w.Spec.Template.Spec.Volumes {
		if v.Secret != nil && v.Secret.SecretName == "metadata-center-tls" && (len(v.Secret.Items) != 1 || v.Secret.Items[0].Key != "ca.crt") {
			t.Errorf("the worker mounts more of metadata-center-tls than ca.crt: %+v", v.Secret)
		}
	}

	if _, ok := find[*networkingv1alpha3.EnvoyFilter](s, "istio-ingress", "llm-filter"); !ok {
		return
	}
	doc := pluginDoc(t, s)
	if !strings.HasPrefix(doc.MetadataCenter.Address, "https://") || doc.MetadataCenter.TLS.CAFile == "" {
		t.Fatalf("the filter's metadata_center is %+v, want https:// and tls.ca_file", doc.MetadataCenter)
	}
	gw := must[*appsv1.Deployment](t, s, "istio-ingress", "llm-gateway")
	secretFile(t, "gateway", gw.Spec.Template.Spec, container(t, gw.Spec.Template.Spec, "istio-proxy"),
		doc.MetadataCenter.TLS.CAFile, "metadata-center-ca", "ca.crt")
	secretFile(t, "gateway", gw.Spec.Template.Spec, container(t, gw.Spec.Template.Spec, "istio-proxy"),
		doc.MetadataCenter.AuthTokenFile, "metadata-center-auth", "token")
	if _, err := config.FromValue(pluginValue(t, s)); err != nil {
		t.Fatalf("the filter refuses the overlay's document: %v", err)
	}
}

// pluginValue is the filter document of the built EnvoyFilter, decoded as
// the parser gets it.
func pluginValue(t *testing.T, s stack) any {
	t.Helper()
	ef := must[*networkingv1alpha3.EnvoyFilter](t, s, "istio-ingress", "llm-filter")
	for _, p := range ef.Spec.ConfigPatches {
		if p.GetApplyTo().String() != "HTTP_FILTER" {
			continue
		}
		js, err := p.GetPatch().GetValue().MarshalJSON()
		if err != nil {
			t.Fatal(err)
		}
		var v struct {
			TypedConfig struct {
				PluginConfig struct {
					Value any `json:"value"`
				} `json:"plugin_config"`
			} `json:"typed_config"`
		}
		if err := json.Unmarshal(js, &v); err != nil {
			t.Fatal(err)
		}
		return v.TypedConfig.PluginConfig.Value
	}
	t.Fatal("no HTTP_FILTER patch")
	return nil
}
