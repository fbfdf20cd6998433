package lifecycle_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/filter/lifecycle"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing"
)

type headers map[string]string

func (h headers) Get(k string) (string, bool) { v, ok := h[k]; return v, ok }

// A host (the Envoy filter, the standalone gateway) decides (routing), pins
// the request to d.Host, and reports the request's lifecycle.
func Example() {
	cfg, err := config.Parse([]byte(`
model_mapping_rule:
  qwen: [{cluster: pool}]
lb_mapping_rule:
  default: {policy: round_robin}
`))
	if err != nil {
		panic(err)
	}
	src, _ := endpoints.NewStatic(map[string][]string{"pool": {"10.0.0.1:8000", "10.0.0.2:8000"}})
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	router, err := routing.New(cfg, routing.Options{Endpoints: src, Logger: log})
	if err != nil {
		panic(err)
	}
	life, err := lifecycle.New(cfg, lifecycle.Options{Tracker: router.Tracker(), Logger: log})
	if err != nil {
		panic(err)
	}
	defer life.Close()

	for range 3 {
		d, err := router.Decide(context.Background(), headers{":path": "/v1/chat/completions", "x-request-id": "t1"},
			[]byte(`{"model":"qwen","messages":[{"role":"user","content":"hi"}]}`))
		if err != nil {
			fmt.Println(string(err.(*routing.Error).JSON()))
			return
		}
		r := lifecycle.NewRequest(d)
		life.Started(r) // request sent upstream
		fmt.Println(d.TraceID, d.Cluster, d.Host, len(d.Hashes))
		life.FirstToken(r) // first byte of the answer
		life.Saved(r)      // the pod now holds this prompt's KV cache
		life.Done(r)       // request over
	}

	_, err = router.Decide(context.Background(), headers{"x-request-id": "t2"}, []byte(`{"model":"llama","prompt":"x"}`))
	fmt.Println(string(err.(*routing.Error).JSON()))
	// Output:
	// t1 pool 10.0.0.1:8000 1
	// t1 pool 10.0.0.2:8000 1
	// t1 pool 10.0.0.1:8000 1
	// {"error":{"code":404,"type":"not_found","message":"model not found: \"llama\""},"trace_id":"t2"}
}
