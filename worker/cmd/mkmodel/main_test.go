package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/worker/ggufgen"
)

func TestRunWritesDeterministicModel(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "models", "tiny.gguf") // parent created on demand
	var stdout, stderr bytes.Buffer
	if err := run([]string{"--out", out, "--seed", "9"}, &stdout, &stderr); err != nil {
		t.Fatalf("%v\n%s", err, stderr.String())
	}
	if !strings.Contains(stdout.String(), "100%") || !strings.Contains(stdout.String(), "wrote "+out) {
		t.Errorf("progress output:\n%s", stdout.String())
	}
	ref := filepath.Join(dir, "ref.gguf")
	if err := ggufgen.WriteFile(ref, ggufgen.Options{Preset: ggufgen.Tiny(), Seed: 9}); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(out)
	b, _ := os.ReadFile(ref)
	if len(a) == 0 || !bytes.Equal(a, b) {
		t.Error("mkmodel --seed 9 differs from the tiny preset with seed 9")
	}
	entries, _ := os.ReadDir(filepath.Dir(out))
	if len(entries) != 1 {
		t.Errorf("leftover files next to the model: %v", entries)
	}
}

func TestRunRejectsBadFlags(t *testing.T) {
	out := filepath.Join(t.TempDir(), "m.gguf")
	for _, args := range [][]string{
		{},
		{"--out", out, "--preset", "huge"},
		{"--out", out, "extra"},
		{"--out", out, "--seed", "-1"},
	} {
		var stdout, stderr bytes.Buffer
		if err := run(args, &stdout, &stderr); err == nil {
			t.Errorf("%q accepted", args)
		}
	}
	if _, err := os.Stat(out); !os.IsNotExist(err) {
		t.Errorf("a rejected invocation wrote %s", out)
	}
}
