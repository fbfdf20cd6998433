package deploy_test

// docs/configuration.md promises every flag and every key. Its tables are
// generated (go run ./internal/confdoc/cmd/gendoc) from the parser's table
// of keys and from the real programs' -h output; these tests fail while the
// page is stale, so the reference cannot drift silently from the code.

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/internal/confdoc"
)

func readDoc(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "docs", name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// The generated tables equal what the generator writes today: the filter's
// keys from config.Keys, every flag of the built metadata center and worker
// with the default and usage their -h prints.
func TestConfigurationDocIsGenerated(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the metadata center and the worker")
	}
	doc := readDoc(t, "configuration.md")
	bin := t.TempDir()
	var pkgs []string
	for _, p := range confdoc.Programs {
		pkgs = append(pkgs, p.Package)
	}
	goBuild(t, bin, pkgs...)
	help := map[string]string{}
	for _, p := range confdoc.Programs {
		h, err := confdoc.Help(filepath.Join(bin, p.Name))
		if err != nil {
			t.Fatal(err)
		}
		help[p.Name] = h
	}
	want, err := confdoc.Generate(doc, help)
	if err != nil {
		t.Fatal(err)
	}
	if want != doc {
		wl, dl := strings.Split(want, "\n"), strings.Split(doc, "\n")
		for i := 0; i < len(wl) || i < len(dl); i++ {
			var w, d string
			if i < len(wl) {
				w = wl[i]
			}
			if i < len(dl) {
				d = dl[i]
			}
			if w != d {
				t.Fatalf("docs/configuration.md is stale (run: . scripts/cgo-env.sh && go run ./internal/confdoc/cmd/gendoc); first difference at line %d:\n doc: %s\nwant: %s", i+1, d, w)
			}
		}
	}
}

// The complete example in the filter section must be a document the filter
// accepts, and every key it uses must be one of config.Keys.
func TestConfigurationDocExampleParses(t *testing.T) {
	doc := readDoc(t, "configuration.md")
	start := strings.Index(doc, "### Complete example")
	if start < 0 {
		t.Fatal("no complete example section")
	}
	m := regexp.MustCompile("(?s)```yaml\n(.*?)```").FindStringSubmatch(doc[start:])
	if m == nil {
		t.Fatal("no yaml block in the complete example")
	}
	cfg, err := config.Parse([]byte(m[1]))
	if err != nil {
		t.Fatalf("the documented example is refused by the filter's parser: %v", err)
	}
	if cfg.MaxBodyBytes != config.DefaultMaxBodyBytes || cfg.PromptHash.ChunkSize != config.DefaultChunkSize {
		t.Errorf("example does not show the defaults it claims: %+v", cfg)
	}
	known := map[string]bool{"default": true} // lb_mapping_rule's <cluster>
	for _, k := range config.Keys {
		for _, seg := range strings.Split(k.Path, ".") {
			known[strings.TrimSuffix(seg, "[i]")] = true
		}
	}
	// Model names and cluster names are data, not keys.
	for _, key := range regexp.MustCompile(`(?m)^\s*(?:- )?([a-z_]+):`).FindAllStringSubmatch(m[1], -1) {
		if _, isModel := cfg.ModelMappingRule[key[1]]; isModel {
			continue
		}
		if !known[key[1]] {
			t.Errorf("key %q of the example is not in config.Keys", key[1])
		}
	}
	for _, key := range regexp.MustCompile(`[{,] ([a-z_]+):`).FindAllStringSubmatch(m[1], -1) {
		if !known[key[1]] {
			t.Errorf("key %q of the example is not in config.Keys", key[1])
		}
	}
}
