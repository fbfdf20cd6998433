package deploy_test

// docs/configuration.md promises every flag and every key. Its tables are
// generated (go run ./internal/confdoc/cmd/gendoc) from the parser's table
// of keys and from the real programs' -h output; these tests fail while the
// page is stale, so the reference cannot drift silently from the code.

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"unicode"

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

// Every relative link of the docs resolves: for each *.md under docs/ and the
// top-level README.md, a link ](path) or ](path#anchor) names a file or
// directory that exists, and an anchor names a heading of the target Markdown
// file (a pure #anchor one of the same file) under GitHub's slug rules. The
// test lists every broken link at once.
func TestDocLinksResolve(t *testing.T) {
	root := ".."
	var files []string
	err := filepath.WalkDir(filepath.Join(root, "docs"), func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() && strings.HasSuffix(p, ".md") {
			files = append(files, p)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	files = append(files, filepath.Join(root, "README.md"))

	anchors := map[string]map[string]bool{} // Markdown file → its anchors
	anchorsOf := func(p string) (map[string]bool, error) {
		if a, ok := anchors[p]; ok {
			return a, nil
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return nil, err
		}
		a := markdownAnchors(string(b))
		anchors[p] = a
		return a, nil
	}

	var broken []string
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		rel, _ := filepath.Rel(root, f)
		for _, l := range markdownLinks(string(b)) {
			target := l.target
			if schemeRE.MatchString(target) {
				continue // http:, https:, mailto: and the like
			}
			path, anchor, _ := strings.Cut(target, "#")
			dest := f
			if path != "" {
				dest = filepath.Join(filepath.Dir(f), filepath.FromSlash(path))
				st, err := os.Stat(dest)
				if err != nil {
					broken = append(broken, fmt.Sprintf("%s:%d: %s: no such file or directory", rel, l.line, target))
					continue
				}
				if st.IsDir() {
					if anchor != "" {
						broken = append(broken, fmt.Sprintf("%s:%d: %s: an anchor on a directory", rel, l.line, target))
					}
					continue
				}
			}
			if anchor == "" {
				continue
			}
			if !strings.HasSuffix(dest, ".md") {
				broken = append(broken, fmt.Sprintf("%s:%d: %s: an anchor on a file that is not Markdown", rel, l.line, target))
				continue
			}
			a, err := anchorsOf(dest)
			if err != nil {
				t.Fatal(err)
			}
			if !a[anchor] {
				broken = append(broken, fmt.Sprintf("%s:%d: %s: no heading with that anchor", rel, l.line, target))
			}
		}
	}
	if len(broken) > 0 {
		t.Errorf("%d broken links:\n%s", len(broken), strings.Join(broken, "\n"))
	}
}

var (
	schemeRE   = regexp.MustCompile(`^[A-Za-z][A-Za-z0-9+.-]*:`)
	linkRE     = regexp.MustCompile(`\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	codeSpanRE = regexp.MustCompile("`[^`]*`")
	headingRE  = regexp.MustCompile(`^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$`)
	htmlIDRE   = regexp.MustCompile(`<a\s+(?:name|id)="([^"]+)"`)
	mdLinkRE   = regexp.MustCompile(`!?\[([^\]]*)\]\([^)]*\)`)
)

type docLink struct {
	line   int
	target string
}

// markdownLinks returns the inline links of a Markdown text outside fenced
// code blocks and code spans.
func markdownLinks(doc string) []docLink {
	var links []docLink
	outsideFences(doc, func(n int, line string) {
		line = codeSpanRE.ReplaceAllString(line, "")
		for _, m := range linkRE.FindAllStringSubmatch(line, -1) {
			links = append(links, docLink{line: n, target: m[1]})
		}
	})
	return links
}

// outsideFences calls fn with each line of doc (numbered from 1) that is
// not inside a fenced code block, the fences themselves left out.
func outsideFences(doc string, fn func(n int, line string)) {
	fence := ""
	for i, line := range strings.Split(doc, "\n") {
		if f := fenceOf(line); f != "" {
			if fence == "" {
				fence = f
			} else if strings.HasPrefix(strings.TrimSpace(line), fence) {
				fence = ""
			}
			continue
		}
		if fence == "" {
			fn(i+1, line)
		}
	}
}

// fenceOf returns the fence a line opens or closes (``` or ~~~), or "".
func fenceOf(line string) string {
	s := strings.TrimLeft(line, " ")
	if len(line)-len(s) > 3 {
		return ""
	}
	for _, f := range []string{"```", "~~~"} {
		if strings.HasPrefix(s, f) {
			return f
		}
	}
	return ""
}

// markdownAnchors returns the anchors GitHub gives a Markdown text: one per
// ATX heading outside fenced code (duplicates suffixed -1, -2, …), and the
// ids of <a id="…"> or <a name="…"> elements.
func markdownAnchors(doc string) map[string]bool {
	anchors := map[string]bool{}
	seen := map[string]int{}
	outsideFences(doc, func(_ int, line string) {
		for _, m := range htmlIDRE.FindAllStringSubmatch(line, -1) {
			anchors[m[1]] = true
		}
		m := headingRE.FindStringSubmatch(line)
		if m == nil {
			return
		}
		slug := githubSlug(m[2])
		if n := seen[slug]; n > 0 {
			anchors[fmt.Sprintf("%s-%d", slug, n)] = true
		} else {
			anchors[slug] = true
		}
		seen[slug]++
	})
	return anchors
}

// githubSlug is GitHub's anchor for a heading's text: the rendered text
// (links by their text, code without its backticks, no emphasis marks)
// lowercased, every character but letters, marks, digits, connector
// punctuation (the underscore), spaces and hyphens dropped, and each space
// turned into a hyphen.
func githubSlug(heading string) string {
	text := mdLinkRE.ReplaceAllString(heading, "$1")
	text = strings.NewReplacer("`", "", "**", "", "__", "").Replace(text)
	var b strings.Builder
	for _, r := range strings.ToLower(text) {
		switch {
		case r == ' ':
			b.WriteByte('-')
		case r == '-' || unicode.IsLetter(r) || unicode.IsMark(r) || unicode.IsDigit(r) || unicode.Is(unicode.Pc, r):
			b.WriteRune(r)
		}
	}
	return b.String()
}
