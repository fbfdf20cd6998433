package routing

import (
	"context"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/balancer"
	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/endpoints"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// memRouter answers the route query from memory: the benchmark measures
// the decision itself (parse + hash + score), not the network.
type memRouter struct{ ans api.RouteAnswer }

func (r memRouter) Route(context.Context, string, []string) (*api.RouteAnswer, error) {
	a := r.ans
	return &a, nil
}

func (memRouter) Pods(context.Context, string) (map[string]api.PodRegistration, error) {
	return nil, nil
}

// benchPrompt builds n bytes of prompt text. "mixed" is deliberately hard
// for the parser: a JSON escape or a multi-byte character every few words.
// "english" is plain ASCII prose with a newline every dozen words or so.
func benchPrompt(kind string, n int) string {
	r := rand.New(rand.NewPCG(7, 8))
	words := []string{"the ", "cache ", "prefix ", "router ", "über ", "模型 ", "token ", "\\n", "\\\"quoted\\\" "}
	if kind == "english" {
		words = []string{"the ", "cache ", "prefix ", "router ", "keeps ", "tokens ", "of ", "each ", "conversation ", "warm ", "and ", "\\n"}
	}
	var b strings.Builder
	for b.Len() < n {
		b.WriteString(words[r.IntN(len(words))])
	}
	return b.String()
}

// BenchmarkDecide is one whole decision without network: parse the OpenAI
// body, match the rule, hash the prompt, filter endpoints and score them
// against a metadata-center answer held in memory. It reports allocations
// and the p50/p99 of single decisions, in wall-clock time and in the
// thread's CPU time (see threadCPU).
func BenchmarkDecide(b *testing.B) {
	type variant struct {
		text string
		size int
	}
	for _, v := range []variant{{"mixed", 8 << 10}, {"mixed", 128 << 10}, {"english", 8 << 10}} {
		body := benchBody(v.text, v.size)
		for _, n := range []int{8, 64, 256} {
			b.Run(fmt.Sprintf("text=%s/prompt=%dKiB/endpoints=%d", v.text, v.size>>10, n), func(b *testing.B) {
				benchDecide(b, body, n, false)
			})
		}
	}
	// Pods that registered labels with the metadata center, as workers
	// started with the downward API's labels file do: the route answer
	// carries them for every pod (docs/envoy-filter.md, label selectors).
	body := benchBody("mixed", 8<<10)
	for _, n := range []int{64, 256} {
		b.Run(fmt.Sprintf("labels=registered/text=mixed/prompt=8KiB/endpoints=%d", n), func(b *testing.B) {
			benchDecide(b, body, n, true)
		})
	}
	// The worst case of the KV admission's shared blocks: pods that report
	// their KV size, each running two of this gateway's requests of the
	// same prompt, so every pod's shared run is walked to the prompt's end.
	for _, n := range []int{64, 256} {
		b.Run(fmt.Sprintf("text=mixed/prompt=8KiB/endpoints=%d/inflight=2", n), func(b *testing.B) {
			benchDecideOpts(b, body, n, false, 2)
		})
	}
}

func benchBody(text string, size int) []byte {
	prompt := benchPrompt(text, size)
	body, _ := json.Marshal(map[string]any{"model": "qwen", "stream": true, "messages": []any{
		map[string]any{"role": "system", "content": prompt[:size/4]},
		map[string]any{"role": "user", "content": prompt[size/4:]},
	}})
	return body
}

func benchDecide(b *testing.B, body []byte, n int, registered bool) {
	benchDecideOpts(b, body, n, registered, 0)
}

// benchDecideOpts is benchDecide with inflight of this gateway's requests
// left running on each pod, which then reports its KV size.
func benchDecideOpts(b *testing.B, body []byte, n int, registered bool, inflight int) {
	addrs := make([]string, n)
	ans := api.RouteAnswer{Load: api.LoadStats{}, Signals: map[string]api.PodSignals{}}
	if registered {
		ans.Pods = map[string]api.PodLabels{}
	}
	for i := range addrs {
		addrs[i] = fmt.Sprintf("10.0.%d.%d:8000", i/250, i%250+1)
		ans.Load[addrs[i]] = api.EndpointStats{TotalReqs: int64(i % 9), PromptLength: int64(i%5) * 4096}
		ans.Signals[addrs[i]] = api.PodSignals{Waiting: int64(i % 3), Running: int64(i % 9), KVCacheUtil: float64(i%10) / 10, AgeMS: 20}
		if inflight > 0 {
			s := ans.Signals[addrs[i]]
			s.KVCapacity = 16 << 10
			ans.Signals[addrs[i]] = s
		}
		if i%4 == 0 {
			ans.Cache = append(ans.Cache, api.CacheLocation{Host: addrs[i], Length: i % 17})
		}
		if registered {
			ans.Pods[addrs[i]] = api.PodLabels{Labels: map[string]string{"app": "worker-qwen", "pod-template-hash": "7d9c6b5f4", "version": "v1"}}
		}
	}
	src, err := endpoints.NewStatic(map[string][]string{"pool": addrs})
	if err != nil {
		b.Fatal(err)
	}
	cfg, err := config.Parse([]byte(`model_mapping_rule: {qwen: [{cluster: pool}]}`))
	if err != nil {
		b.Fatal(err)
	}
	e, err := New(cfg, Options{Endpoints: src, Querier: memRouter{ans}, Logger: quiet()})
	if err != nil {
		b.Fatal(err)
	}
	h := hdr{":path": "/v1/chat/completions", "x-request-id": "bench"}
	ctx := context.Background()
	if inflight > 0 {
		d, err := e.Decide(ctx, h, body)
		if err != nil {
			b.Fatal(err)
		}
		for _, a := range addrs {
			for range inflight {
				e.Tracker().Begin(d.Cluster, a, d.PrefillLength, d.Prompt())
			}
		}
	}
	var wall, cpu []time.Duration
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		start, startCPU := time.Now(), threadCPU()
		d, err := e.Decide(ctx, h, body)
		if err != nil {
			b.Fatal(err)
		}
		cpu = append(cpu, threadCPU()-startCPU)
		wall = append(wall, time.Since(start))
		// The request starts and ends outside the decision's own timing:
		// its reservation is taken over and nothing of it is left for the
		// next decision to count. (Not b.StopTimer: with ReportAllocs it
		// reads the memory stats, stopping the world at every decision.)
		e.Tracker().Begin(d.Cluster, d.Host, d.PrefillLength, balancer.Request{}).End()
	}
	reportLatencies(b, wall, cpu)
}

// BenchmarkTimingFloor times, as benchDecide times a decision, a fixed
// computation about as long that allocates nothing and calls nothing but
// the CRC instruction: what it adds to its p50 at p99 is the machine's own
// share of a decision's tail (timer interrupts, the hypervisor), read
// side by side with BenchmarkDecide in one run (docs/benchmarks.md).
func BenchmarkTimingFloor(b *testing.B) {
	buf := make([]byte, 64<<10)
	for i := range buf {
		buf[i] = byte(i * 7)
	}
	var wall, cpu []time.Duration
	var sum uint32
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	for b.Loop() {
		start, startCPU := time.Now(), threadCPU()
		for range 10 {
			sum += crc32.ChecksumIEEE(buf)
		}
		cpu = append(cpu, threadCPU()-startCPU)
		wall = append(wall, time.Since(start))
	}
	runtime.KeepAlive(sum)
	reportLatencies(b, wall, cpu)
}

func reportLatencies(b *testing.B, wall, cpu []time.Duration) {
	slices.Sort(wall)
	slices.Sort(cpu)
	us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }
	b.ReportMetric(us(wall[len(wall)/2]), "p50-µs")
	b.ReportMetric(us(wall[len(wall)*99/100]), "p99-µs")
	b.ReportMetric(us(cpu[len(cpu)/2]), "cpu-p50-µs")
	b.ReportMetric(us(cpu[len(cpu)*99/100]), "cpu-p99-µs")
}
