// Package testmodel gives tests the path of a real GGUF model for llama.cpp:
// the one CI generated ($LLMF_TEST_MODEL, see scripts/test.sh), or else the
// tiny preset generated once into the user's cache directory.
package testmodel

import (
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/worker/ggufgen"
)

// EnvVar names the environment variable that points tests at a model file.
const EnvVar = "LLMF_TEST_MODEL"

// Path returns the model tests should load. With $LLMF_TEST_MODEL unset it
// generates ggufgen's tiny preset (default seed) into
// <user cache dir>/istio-llm-filter/<preset id>.gguf unless it is already
// there. The file name carries the generator version, shape and seed, and the
// write is temp-file-then-rename, so concurrent test processes never see a
// partial or stale model; at worst two of them generate identical bytes.
func Path(t testing.TB) string {
	t.Helper()
	if p := os.Getenv(EnvVar); p != "" {
		if _, err := os.Stat(p); err != nil {
			t.Fatalf("testmodel: $%s=%q: %v (run `make model`, or unset it to generate one)", EnvVar, p, err)
		}
		return p
	}
	dir, err := os.UserCacheDir()
	if err != nil {
		dir = os.TempDir()
	}
	dir = filepath.Join(dir, "istio-llm-filter")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatalf("testmodel: %v", err)
	}
	preset := ggufgen.Tiny()
	path := filepath.Join(dir, preset.ID(ggufgen.DefaultSeed)+".gguf")
	if st, err := os.Stat(path); err == nil && st.Mode().IsRegular() {
		return path
	}
	if err := ggufgen.WriteFile(path, ggufgen.Options{Preset: preset, Seed: ggufgen.DefaultSeed}); err != nil {
		t.Fatalf("testmodel: generating %s: %v", path, err)
	}
	return path
}

// ToolsPath is the tiny preset with Qwen2.5's chat template
// (ggufgen.QwenToolsTemplate), which renders tools and tool calls:
// generated once into the user's cache directory like Path's model.
func ToolsPath(t testing.TB) string {
	t.Helper()
	dir, err := os.UserCacheDir()
	if err != nil {
		dir = os.TempDir()
	}
	dir = filepath.Join(dir, "istio-llm-filter")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatalf("testmodel: %v", err)
	}
	preset := ggufgen.Tiny()
	path := filepath.Join(dir, fmt.Sprintf("%s-tpl%08x.gguf", preset.ID(ggufgen.DefaultSeed), crc32.ChecksumIEEE([]byte(ggufgen.QwenToolsTemplate))))
	if st, err := os.Stat(path); err == nil && st.Mode().IsRegular() {
		return path
	}
	o := ggufgen.Options{Preset: preset, Seed: ggufgen.DefaultSeed, ChatTemplate: ggufgen.QwenToolsTemplate}
	if err := ggufgen.WriteFile(path, o); err != nil {
		t.Fatalf("testmodel: generating %s: %v", path, err)
	}
	return path
}
