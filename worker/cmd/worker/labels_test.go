package main

import (
	"context"
	"io"
	"log/slog"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/client"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/server"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
)

// Labels come from the downward API file, the env and --label, each
// overriding the one before; bad ones stop the worker with a clear error.
func TestLabels(t *testing.T) {
	file := filepath.Join(t.TempDir(), "labels")
	// What the kubelet writes for metadata.labels.
	if err := os.WriteFile(file, []byte("app=\"worker\"\npool=\"bronze\"\npod-template-hash=\"7c9d\"\nnote=\"a \\\"quoted\\\" one\"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	o, err := parse([]string{"--engine", "sim", "--labels-file", file, "--label", "pool=gold", "--label", "gpu=l4"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	env := func(k string) string {
		if k == LabelsEnv {
			return "gpu=t4, zone=eu-1,"
		}
		return ""
	}
	got, err := o.labels(env)
	want := map[string]string{"app": "worker", "pool": "gold", "pod-template-hash": "7c9d", "note": `a "quoted" one`, "gpu": "l4", "zone": "eu-1"}
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("labels = %v %v, want %v", got, err, want)
	}

	for _, c := range []struct {
		args []string
		msg  string
	}{
		{[]string{"--label", "pool"}, "want key=value"},
		{[]string{"--label", "=x"}, "want key=value"},
		{[]string{"--label", "a=1", "--label", "a=2"}, `label "a" given twice`},
		{[]string{"--label", "k=" + strings.Repeat("v", 300)}, "value at most 256"},
		{[]string{"--labels-file", filepath.Join(t.TempDir(), "missing")}, "--labels-file"},
	} {
		if _, err := parse(append([]string{"--engine", "sim"}, c.args...), io.Discard); err == nil || !strings.Contains(err.Error(), c.msg) {
			t.Errorf("parse(%q) = %v, want an error with %q", c.args, err, c.msg)
		}
	}
	bad := filepath.Join(t.TempDir(), "bad")
	if err := os.WriteFile(bad, []byte("ok=\"1\"\nbroken=\"unterminated\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := parse([]string{"--engine", "sim", "--labels-file", bad}, io.Discard); err == nil || !strings.Contains(err.Error(), ":2: bad quoted value") {
		t.Errorf("a broken labels file: %v", err)
	}
	o, _ = parse([]string{"--engine", "sim"}, io.Discard)
	if _, err := o.labels(func(string) string { return "novalue" }); err == nil || !strings.Contains(err.Error(), LabelsEnv) {
		t.Errorf("a bad %s: %v", LabelsEnv, err)
	}
}

// A worker started with --label and a real metadata center registers its
// labels and model, under the port it really listens on when --listen
// asked for port 0.
func TestRegistersWithTheMetadataCenter(t *testing.T) {
	mc := httptest.NewServer(server.New(memstore.New(memstore.Options{}), server.Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}).Handler())
	defer mc.Close()
	url := start(t, "--engine", "sim", "--sim-step-overhead", "1ms", "--metadata-center", mc.URL, "--cluster", "pool",
		"--model-name", "tiny", "--label", "pool=gold", "--label", "gpu=l4")
	host := strings.TrimPrefix(url, "http://")
	mcc, err := client.New(client.Options{Address: mc.URL})
	if err != nil {
		t.Fatal(err)
	}
	var pods map[string]api.PodRegistration
	if !wait.Until(10*time.Second, func() bool {
		pods, err = mcc.Pods(context.Background(), "pool")
		if err != nil {
			t.Fatal(err)
		}
		p, ok := pods[host]
		return ok && reflect.DeepEqual(p.Labels, map[string]string{"pool": "gold", "gpu": "l4"}) && reflect.DeepEqual(p.Models, []string{"tiny"})
	}) {
		t.Fatalf("registrations %+v, want %s with its labels and model", pods, host)
	}
}
