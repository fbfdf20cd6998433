package testmodel_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/ollama/ollama/fs/ggml"

	"github.com/istio-llm-filter/istio-llm-filter/worker/ggufgen"
	"github.com/istio-llm-filter/istio-llm-filter/worker/testmodel"
)

// helperEnv makes the test binary act as one of several racing test
// processes: call Path and print the result.
const helperEnv = "TESTMODEL_HELPER_PROCESS"

func TestHelperProcess(t *testing.T) {
	if os.Getenv(helperEnv) != "1" {
		t.Skip("helper for TestPathRacingProcesses")
	}
	fmt.Println(testmodel.Path(t))
}

func TestPathRacingProcesses(t *testing.T) {
	cache := t.TempDir()
	const procs = 4
	outs := make([][]byte, procs)
	errs := make([]error, procs)
	var wg sync.WaitGroup
	for i := range procs {
		wg.Go(func() {
			cmd := exec.Command(os.Args[0], "-test.run=^TestHelperProcess$")
			cmd.Env = append(os.Environ(), helperEnv+"=1", testmodel.EnvVar+"=", "XDG_CACHE_HOME="+cache, "HOME="+cache)
			outs[i], errs[i] = cmd.CombinedOutput()
		})
	}
	wg.Wait()
	want := filepath.Join(cache, "istio-llm-filter", ggufgen.Tiny().ID(ggufgen.DefaultSeed)+".gguf")
	for i := range procs {
		if errs[i] != nil || !strings.Contains(string(outs[i]), want+"\n") {
			t.Fatalf("process %d: %v\n%s", i, errs[i], outs[i])
		}
	}
	f, err := os.Open(want)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	g, err := ggml.Decode(f, -1)
	if err != nil {
		t.Fatalf("racing generators left a broken file: %v", err)
	}
	if g.KV().ContextLength() < 8192 {
		t.Errorf("context length %d", g.KV().ContextLength())
	}
	entries, err := os.ReadDir(filepath.Dir(want))
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 1 {
		t.Errorf("cache dir holds %v, want only the model", entries)
	}

	// In-process now: the cached file is reused, not regenerated.
	t.Setenv(testmodel.EnvVar, "")
	t.Setenv("XDG_CACHE_HOME", cache)
	t.Setenv("HOME", cache)
	before, _ := os.Stat(want)
	if got := testmodel.Path(t); got != want {
		t.Fatalf("path %s, want %s", got, want)
	}
	after, _ := os.Stat(want)
	if !after.ModTime().Equal(before.ModTime()) {
		t.Error("an existing model was regenerated")
	}
}

func TestPathHonoursEnv(t *testing.T) {
	p := filepath.Join(t.TempDir(), "given.gguf")
	if err := ggufgen.WriteFile(p, ggufgen.Options{Preset: ggufgen.Tiny(), Seed: 5}); err != nil {
		t.Fatal(err)
	}
	t.Setenv(testmodel.EnvVar, p)
	if got := testmodel.Path(t); got != p {
		t.Errorf("got %s, want $%s = %s", got, testmodel.EnvVar, p)
	}
}
