package poolsource_test

import (
	"context"
	"io"
	"log/slog"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynfake "k8s.io/client-go/dynamic/fake"
	kfake "k8s.io/client-go/kubernetes/fake"
	giev1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/istio-llm-filter/istio-llm-filter/filter/epp/poolsource"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

// The API server is client-go's own fakes (k8s.io/client-go/kubernetes/fake,
// dynamic/fake): the informers list and watch them as they would a real one.

func pod(name, ip string, labels map[string]string, isReady bool) *corev1.Pod {
	st := corev1.ConditionFalse
	if isReady {
		st = corev1.ConditionTrue
	}
	return &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "llm", Labels: labels},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip,
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: st}}},
	}
}

func pool(ports ...int32) *unstructured.Unstructured {
	p := &giev1.InferencePool{
		TypeMeta:   metav1.TypeMeta{APIVersion: giev1.SchemeGroupVersion.String(), Kind: "InferencePool"},
		ObjectMeta: metav1.ObjectMeta{Name: "tiny", Namespace: "llm"},
		Spec: giev1.InferencePoolSpec{
			Selector:          giev1.LabelSelector{MatchLabels: map[giev1.LabelKey]giev1.LabelValue{"model": "tiny"}},
			EndpointPickerRef: giev1.EndpointPickerRef{Name: "epp"},
		},
	}
	for _, n := range ports {
		p.Spec.TargetPorts = append(p.Spec.TargetPorts, giev1.Port{Number: giev1.PortNumber(n)})
	}
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(p)
	if err != nil {
		panic(err)
	}
	return &unstructured.Unstructured{Object: m}
}

func addrs(s *poolsource.Source) []string {
	var out []string
	for _, e := range s.Endpoints("tiny") {
		out = append(out, e.Address)
	}
	return out
}

func TestReadyPodsOfThePoolAreItsEndpoints(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tiny := map[string]string{"model": "tiny", "lora": "a"}
	kc := kfake.NewClientset(
		pod("w1", "10.0.0.1", tiny, true),
		pod("w2", "10.0.0.2", tiny, false), // not ready
		pod("other", "10.0.0.3", map[string]string{"model": "big"}, true),
	)
	scheme := runtime.NewScheme()
	dc := dynfake.NewSimpleDynamicClientWithCustomListKinds(scheme,
		map[schema.GroupVersionResource]string{poolsource.Resource: "InferencePoolList"}, pool(8000))
	s, err := poolsource.Start(ctx, kc, dc, "llm", "tiny", slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	wait.For(t, 5*time.Second, "the ready selected pod", func() bool { return slices.Equal(addrs(s), []string{"10.0.0.1:8000"}) })
	if eps := s.Endpoints("tiny"); eps[0].Labels["lora"] != "a" {
		t.Fatalf("labels %v", eps[0].Labels)
	}
	if got := s.Endpoints("some-other-cluster"); got != nil {
		t.Fatalf("another cluster answered %v", got)
	}

	// w2 becomes ready; w1 goes away.
	if _, err := kc.CoreV1().Pods("llm").UpdateStatus(ctx, pod("w2", "10.0.0.2", tiny, true), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := kc.CoreV1().Pods("llm").Delete(ctx, "w1", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 5*time.Second, "w2 alone", func() bool { return slices.Equal(addrs(s), []string{"10.0.0.2:8000"}) })

	// A second target port makes every pod two endpoints.
	if _, err := dc.Resource(poolsource.Resource).Namespace("llm").Update(ctx, pool(8000, 8001), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 5*time.Second, "two ports", func() bool {
		return slices.Equal(addrs(s), []string{"10.0.0.2:8000", "10.0.0.2:8001"})
	})

	// The pool is deleted: no endpoints.
	if err := dc.Resource(poolsource.Resource).Namespace("llm").Delete(ctx, "tiny", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	wait.For(t, 5*time.Second, "no endpoints without the pool", func() bool { return len(addrs(s)) == 0 })
}
