package deploy_test

import (
	"fmt"
	"path"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/labels"
	giev1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"

	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewayfile"
)

// The endpoint-picker install (deploy/inferencepool) is wired the way the
// picker needs it: the route reaches the pool, the pool's picker is our
// EPP's Service, the pool selects the workers at their port, the EPP reads
// a valid file whose rules name the pool, and may watch what it needs.
func TestEndpointPickerInstall(t *testing.T) { checkEndpointPicker(t, build(t, "inferencepool")) }

func checkEndpointPicker(t *testing.T, s stack) {
	t.Helper()
	const ns = "llm"
	d := must[*appsv1.Deployment](t, s, ns, "epp")
	c := container(t, d.Spec.Template.Spec, "epp")
	poolName, _ := flagValue(c.Args, "pool-name")
	pool := must[*giev1.InferencePool](t, s, ns, poolName)

	route := must[*gatewayv1.HTTPRoute](t, s, ns, "llm")
	checkHTTPRoutePaths(t, route)
	reached := false
	for _, r := range route.Spec.Rules {
		for _, b := range r.BackendRefs {
			if b.Group != nil && string(*b.Group) == giev1.GroupName && b.Kind != nil && *b.Kind == "InferencePool" && string(b.Name) == pool.Name {
				reached = true
			}
		}
	}
	if !reached {
		t.Errorf("HTTPRoute llm does not send to InferencePool %s", pool.Name)
	}
	gw := must[*gatewayv1.Gateway](t, s, ns, string(route.Spec.ParentRefs[0].Name))
	if gw.Spec.GatewayClassName != "istio" {
		t.Errorf("gateway class %q, want istio", gw.Spec.GatewayClassName)
	}

	// The pool's picker is the EPP's Service, on the port the EPP serves.
	ref := pool.Spec.EndpointPickerRef
	svc := must[*corev1.Service](t, s, ns, string(ref.Name))
	if ref.Port == nil || len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Port != int32(ref.Port.Number) {
		t.Fatalf("endpointPickerRef port %v, Service ports %+v", ref.Port, svc.Spec.Ports)
	}
	if !labels.SelectorFromSet(svc.Spec.Selector).Matches(labels.Set(d.Spec.Template.Labels)) {
		t.Errorf("Service %s does not select the EPP's pods", svc.Name)
	}

	// The pool selects the workers, at their container port.
	sel := map[string]string{}
	for k, v := range pool.Spec.Selector.MatchLabels {
		sel[string(k)] = string(v)
	}
	w := must[*appsv1.Deployment](t, s, ns, "worker-tiny")
	if !labels.SelectorFromSet(sel).Matches(labels.Set(w.Spec.Template.Labels)) {
		t.Errorf("pool selector %v does not match the workers %v", sel, w.Spec.Template.Labels)
	}
	wport := w.Spec.Template.Spec.Containers[0].Ports[0].ContainerPort
	if len(pool.Spec.TargetPorts) != 1 || int32(pool.Spec.TargetPorts[0].Number) != wport {
		t.Errorf("pool targetPorts %v, worker port %d", pool.Spec.TargetPorts, wport)
	}

	// The file parses as the EPP parses it; its gRPC port is the Service's
	// target, and every rule names the pool.
	cfgPath, _ := flagValue(c.Args, "config")
	var data string
	for _, v := range d.Spec.Template.Spec.Volumes {
		if v.ConfigMap == nil {
			continue
		}
		for _, m := range c.VolumeMounts {
			if m.Name == v.Name && strings.HasPrefix(cfgPath, m.MountPath+"/") {
				cm := must[*corev1.ConfigMap](t, s, ns, v.ConfigMap.Name)
				data = cm.Data[path.Base(cfgPath)]
			}
		}
	}
	if data == "" {
		t.Fatalf("--config=%s is not a mounted ConfigMap key", cfgPath)
	}
	fc, cfg, err := gatewayfile.Parse(cfgPath, []byte(data))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasSuffix(fc.Listen, fmt.Sprintf(":%d", ref.Port.Number)) {
		t.Errorf("the EPP listens on %s, the pool's picker port is %d", fc.Listen, ref.Port.Number)
	}
	for model, rules := range cfg.ModelMappingRule {
		for _, r := range rules {
			if r.Cluster != pool.Name {
				t.Errorf("model %s: rule cluster %q is not the pool %q", model, r.Cluster, pool.Name)
			}
		}
	}

	// The EPP may list and watch pods and pools in its namespace.
	rb := must[*rbacv1.RoleBinding](t, s, ns, "epp")
	role := must[*rbacv1.Role](t, s, ns, rb.RoleRef.Name)
	if rb.Subjects[0].Name != d.Spec.Template.Spec.ServiceAccountName {
		t.Errorf("RoleBinding subject %s, EPP service account %s", rb.Subjects[0].Name, d.Spec.Template.Spec.ServiceAccountName)
	}
	can := map[string]bool{}
	for _, r := range role.Rules {
		for _, res := range r.Resources {
			for _, v := range r.Verbs {
				can[res+"/"+v] = true
			}
		}
	}
	for _, need := range []string{"pods/list", "pods/watch", "inferencepools/list", "inferencepools/watch"} {
		if !can[need] {
			t.Errorf("the EPP's Role lacks %s", need)
		}
	}
}
