package deploy_test

// docs/configuration.md promises every flag and every key. These tests hold
// it to that against the real programs and the real parser, so the reference
// cannot drift silently from the code.

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
)

func readDoc(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "docs", name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// flagNames runs a program with -h and reads the flag names off Go's usage.
func flagNames(t *testing.T, path string) []string {
	t.Helper()
	out, _ := exec.Command(path, "-h").CombinedOutput() // -h exits non-zero by design
	var names []string
	for _, m := range regexp.MustCompile(`(?m)^\s+-([a-z0-9][a-z0-9-]*)`).FindAllStringSubmatch(string(out), -1) {
		names = append(names, m[1])
	}
	if len(names) == 0 {
		t.Fatalf("%s -h listed no flags:\n%s", path, out)
	}
	return names
}

func TestConfigurationDocListsEveryFlag(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the metadata center and the worker")
	}
	doc := readDoc(t, "configuration.md")
	bin := t.TempDir()
	goBuild(t, bin, "./metadata-center/cmd/metadata-center", "./worker/cmd/worker")
	for _, prog := range []string{"metadata-center", "worker"} {
		for _, name := range flagNames(t, filepath.Join(bin, prog)) {
			if !strings.Contains(doc, "`--"+name+"`") {
				t.Errorf("docs/configuration.md does not document %s --%s", prog, name)
			}
		}
	}
}

// The complete example in the filter section must be a document the filter
// accepts; and every key the parser knows must have a row in the tables.
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
	// Keys the example uses must each have a table row (`key` in backticks).
	// Model names are data, not keys.
	for _, key := range regexp.MustCompile(`(?m)^\s*(?:- )?([a-z_]+):`).FindAllStringSubmatch(m[1], -1) {
		if _, isModel := cfg.ModelMappingRule[key[1]]; isModel {
			continue
		}
		if !strings.Contains(doc, "| `"+key[1]+"`") && !strings.Contains(doc, "`"+key[1]+".") && !strings.Contains(doc, "Key `"+key[1]+"`") {
			t.Errorf("key %q of the example has no row in docs/configuration.md", key[1])
		}
	}
}

// The parser names the keys it allows when it refuses an unknown one; every
// such key, at every level, must have a row in the tables.
func TestConfigurationDocListsEveryFilterKey(t *testing.T) {
	doc := readDoc(t, "configuration.md")
	const rule = `model_mapping_rule: {m: [{cluster: c, %s}]}`
	probes := map[string]string{
		"top level":               "zz_unknown: 1\n" + strings.Replace(rule, ", %s", "", 1),
		"metadata_center":         "metadata_center: {zz_unknown: 1}\n" + strings.Replace(rule, ", %s", "", 1),
		"prompt_hash":             "prompt_hash: {zz_unknown: 1}\n" + strings.Replace(rule, ", %s", "", 1),
		"model_mapping_rule rule": strings.Replace(rule, "%s", "zz_unknown: 1", 1),
		"lb_mapping_rule entry":   "lb_mapping_rule: {default: {zz_unknown: 1}}\n" + strings.Replace(rule, ", %s", "", 1),
		"endpoints":               "endpoints: {zz_unknown: 1}\n" + strings.Replace(rule, ", %s", "", 1),
		"endpoints.envoy_admin":   "endpoints: {envoy_admin: {address: 'http://127.0.0.1:15000', zz_unknown: 1}}\n" + strings.Replace(rule, ", %s", "", 1),
		"async":                   "async: {zz_unknown: 1}\n" + strings.Replace(rule, ", %s", "", 1),
	}
	allowedRE := regexp.MustCompile(`zz_unknown: unknown key \(allowed: ([a-z_, ]+)\)`)
	for where, probe := range probes {
		_, err := config.Parse([]byte(probe))
		if err == nil {
			t.Errorf("%s: the parser accepted an unknown key", where)
			continue
		}
		m := allowedRE.FindStringSubmatch(err.Error())
		if m == nil {
			t.Errorf("%s: cannot read the allowed keys from %q", where, err)
			continue
		}
		for _, key := range strings.Split(m[1], ", ") {
			if !strings.Contains(doc, "| `"+key+"`") && !strings.Contains(doc, "| `"+key+".") && !strings.Contains(doc, "| `envoy_admin."+key+"`") {
				t.Errorf("%s: key %q has no row in docs/configuration.md", where, key)
			}
		}
	}
}
