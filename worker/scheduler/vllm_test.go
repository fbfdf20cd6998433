package scheduler

import (
	"context"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// vllm:lora_requests_info carries vLLM's labels: the adapters of the
// running and of the waiting requests (every loaded one: this worker
// applies them to every sequence) and max_lora.
func TestVLLMLoRAInfoNamesTheAdaptersOfRunningAndWaitingRequests(t *testing.T) {
	r := newRig(t, slow(), Config{MaxRunning: 1, MaxOutputTokens: 4000}, false)
	reg := prometheus.NewRegistry()
	if err := r.s.ExportVLLM(reg, "base", []string{"sql", "chat"}); err != nil {
		t.Fatal(err)
	}
	r.start()
	info := func() string {
		t.Helper()
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() != "vllm:lora_requests_info" {
				continue
			}
			var labels []string
			for _, l := range mf.GetMetric()[0].GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			if v := mf.GetMetric()[0].GetGauge().GetValue(); v < 1e9 {
				t.Fatalf("lora_requests_info value %v; vLLM sets the time of the reading", v)
			}
			return strings.Join(labels, " ")
		}
		t.Fatal("no vllm:lora_requests_info")
		return ""
	}
	if got, want := info(), "max_lora=2 model_name=base running_lora_adapters= waiting_lora_adapters="; got != want {
		t.Fatalf("idle: %s, want %s", got, want)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	long, err := r.s.Submit(ctx, &Request{ID: "long", Prompt: prompt(r.eng, "keep going"), MaxTokens: 4000, IgnoreEOS: true})
	if err != nil {
		t.Fatal(err)
	}
	<-long.Ready()
	if _, err := r.s.Submit(ctx, &Request{ID: "queued", Prompt: prompt(r.eng, "wait"), MaxTokens: 1}); err != nil {
		t.Fatal(err)
	}
	if got, want := info(), "max_lora=2 model_name=base running_lora_adapters=sql,chat waiting_lora_adapters=sql,chat"; got != want {
		t.Fatalf("busy: %s, want %s", got, want)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		got[mf.GetName()] = mf.GetMetric()[0].GetGauge().GetValue()
	}
	if got["vllm:num_requests_running"] != 1 || got["vllm:num_requests_waiting"] != 1 {
		t.Fatalf("running %v, waiting %v", got["vllm:num_requests_running"], got["vllm:num_requests_waiting"])
	}
}
