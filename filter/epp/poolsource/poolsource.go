// Package poolsource is an endpoints.Source over a Kubernetes
// InferencePool (Gateway API Inference Extension, inference.networking.k8s.io/v1):
// the ready pods its selector matches in its namespace, each at every one
// of its targetPorts ("podIP:port"), with the pods' labels for the rules'
// label selectors. The pool's name is the cluster the routing rules name.
package poolsource

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	giev1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"

	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
)

// Resource is the InferencePool's API resource.
var Resource = giev1.SchemeGroupVersion.WithResource("inferencepools")

// Source answers the pool's endpoints for the cluster named as the pool;
// safe for concurrent use, it never blocks on the API server.
type Source struct {
	name, namespace string
	log             *slog.Logger

	mu   sync.RWMutex
	pool *giev1.InferencePool
	pods map[string]*corev1.Pod // by name
	eps  []endpoints.Endpoint
}

var _ endpoints.Source = (*Source)(nil)

// Start watches the pool namespace/name and its namespace's pods until ctx
// ends, and returns once both caches have synced (within SyncTimeout).
func Start(ctx context.Context, kc kubernetes.Interface, dc dynamic.Interface, namespace, name string, log *slog.Logger) (*Source, error) {
	if log == nil {
		log = slog.Default()
	}
	s := &Source{name: name, namespace: namespace, log: log, pods: map[string]*corev1.Pod{}}
	pf := informers.NewSharedInformerFactoryWithOptions(kc, 0, informers.WithNamespace(namespace))
	podInf := pf.Core().V1().Pods().Informer()
	if _, err := podInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { s.setPod(o, false) },
		UpdateFunc: func(_, o any) { s.setPod(o, false) },
		DeleteFunc: func(o any) { s.setPod(o, true) },
	}); err != nil {
		return nil, err
	}
	df := dynamicinformer.NewFilteredDynamicSharedInformerFactory(dc, 0, namespace, func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("metadata.name", name).String()
	})
	poolInf := df.ForResource(Resource).Informer()
	if _, err := poolInf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { s.setPool(o, false) },
		UpdateFunc: func(_, o any) { s.setPool(o, false) },
		DeleteFunc: func(o any) { s.setPool(o, true) },
	}); err != nil {
		return nil, err
	}
	pf.Start(ctx.Done())
	df.Start(ctx.Done())
	syncCtx, cancel := context.WithTimeout(ctx, SyncTimeout)
	defer cancel()
	if !cache.WaitForCacheSync(syncCtx.Done(), podInf.HasSynced, poolInf.HasSynced) {
		return nil, fmt.Errorf("poolsource: the caches of pool %s/%s did not sync within %v: %w", namespace, name, SyncTimeout, syncCtx.Err())
	}
	return s, nil
}

// Endpoints returns a copy of the pool's endpoints when cluster is its name.
func (s *Source) Endpoints(cluster string) []endpoints.Endpoint {
	if cluster != s.name {
		return nil
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	return slices.Clone(s.eps)
}

// Name is the pool's name, the cluster its endpoints answer to.
func (s *Source) Name() string { return s.name }

func (s *Source) setPod(o any, deleted bool) {
	if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
		o, deleted = t.Obj, true
	}
	p, ok := o.(*corev1.Pod)
	if !ok {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if deleted {
		delete(s.pods, p.Name)
	} else {
		s.pods[p.Name] = p
	}
	s.rebuild()
}

func (s *Source) setPool(o any, deleted bool) {
	if t, ok := o.(cache.DeletedFinalStateUnknown); ok {
		o, deleted = t.Obj, true
	}
	u, ok := o.(*unstructured.Unstructured)
	if !ok {
		return
	}
	var pool *giev1.InferencePool
	if !deleted {
		pool = &giev1.InferencePool{}
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, pool); err != nil {
			s.log.Error("InferencePool does not decode: keeping the last one", "pool", s.name, "err", err)
			return
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.pool = pool
	s.rebuild()
}

// rebuild recomputes the endpoints; s.mu held.
func (s *Source) rebuild() {
	var eps []endpoints.Endpoint
	if s.pool != nil {
		names := slices.Sorted(maps.Keys(s.pods))
		for _, n := range names {
			p := s.pods[n]
			if !s.selects(p) || !ready(p) {
				continue
			}
			for _, port := range s.pool.Spec.TargetPorts {
				eps = append(eps, endpoints.Endpoint{
					Address: net.JoinHostPort(p.Status.PodIP, strconv.Itoa(int(port.Number))),
					Labels:  maps.Clone(p.Labels),
				})
			}
		}
	}
	if len(eps) != len(s.eps) {
		s.log.Info("InferencePool endpoints changed", "pool", s.name, "endpoints", len(eps))
	}
	s.eps = eps
}

func (s *Source) selects(p *corev1.Pod) bool {
	sel := s.pool.Spec.Selector.MatchLabels
	if len(sel) == 0 {
		return false // the API requires a selector; an empty one selects nothing here
	}
	for k, v := range sel {
		if p.Labels[string(k)] != string(v) {
			return false
		}
	}
	return true
}

// ready: running, with an IP, not terminating, and Ready.
func ready(p *corev1.Pod) bool {
	if p.Status.PodIP == "" || p.DeletionTimestamp != nil || p.Status.Phase != corev1.PodRunning {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// SyncTimeout bounds Start's wait for the first list of the pool and pods.
const SyncTimeout = 2 * time.Minute
