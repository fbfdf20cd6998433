// Package confdoc writes the generated tables of docs/configuration.md: the
// filter document's keys from config.Keys, and the metadata center's and the
// worker's flags from their binaries' -h output. Each table sits between
//
//	<!-- BEGIN GENERATED name -->
//	<!-- END GENERATED name -->
//
// markers; Generate rewrites what lies between them and leaves the rest of
// the page alone. `go run ./internal/confdoc/cmd/gendoc` updates the page;
// deploy's TestConfigurationDocIsGenerated fails while it is stale.
package confdoc

import (
	"errors"
	"fmt"
	"os/exec"
	"regexp"
	"strconv"
	"strings"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
)

// Section names of the generated tables.
const (
	FilterKeys          = "filter-keys"
	MetadataCenterFlags = "metadata-center-flags"
	WorkerFlags         = "worker-flags"
)

// Programs are the binaries whose flags the page lists, by section, with
// their packages.
var Programs = []struct{ Section, Name, Package string }{
	{MetadataCenterFlags, "metadata-center", "./metadata-center/cmd/metadata-center"},
	{WorkerFlags, "worker", "./worker/cmd/worker"},
}

// Flag is one flag as Go's flag package prints it under -h.
type Flag struct {
	Name, Type, Default, Usage string
}

var defaultRE = regexp.MustCompile(` \(default (.*)\)$`)

// ParseHelp reads the flags off a program's -h output (flag.PrintDefaults).
func ParseHelp(help string) ([]Flag, error) {
	var flags []Flag
	for _, line := range strings.Split(help, "\n") {
		switch {
		case strings.HasPrefix(line, "  -"):
			head, usage, _ := strings.Cut(strings.TrimPrefix(line, "  -"), "\t") // one-letter flags keep usage on their line
			name, typ, _ := strings.Cut(strings.TrimSpace(head), " ")
			flags = append(flags, Flag{Name: name, Type: typ, Usage: strings.TrimSpace(usage)})
		case strings.HasPrefix(line, "    \t") && len(flags) > 0:
			f := &flags[len(flags)-1]
			f.Usage = strings.TrimSpace(f.Usage + " " + strings.TrimSpace(line))
		}
	}
	if len(flags) == 0 {
		return nil, errors.New("no flags in the -h output")
	}
	for i := range flags {
		f := &flags[i]
		if f.Type == "" {
			f.Type = "bool"
		}
		m := defaultRE.FindStringSubmatch(f.Usage)
		if m == nil {
			continue
		}
		def := m[1]
		if s, err := strconv.Unquote(def); err == nil {
			def = s
		} else if f.Type == "string" {
			continue // the flag package quotes string defaults: this one is the usage's own words
		}
		f.Default, f.Usage = def, strings.TrimSuffix(f.Usage, m[0])
	}
	return flags, nil
}

// Help runs a built program with -h in an empty environment, so that no
// variable of the caller's shows up as a default.
func Help(path string) (string, error) {
	cmd := exec.Command(path, "-h")
	cmd.Env = []string{}
	out, err := cmd.CombinedOutput()
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) { // -h exits non-zero by design
		return "", err
	}
	return string(out), nil
}

func cell(s string) string {
	return strings.ReplaceAll(s, "|", `\|`)
}

func code(s string) string {
	if s == "" {
		return ""
	}
	return "`" + cell(s) + "`"
}

// FilterTable renders config.Keys.
func FilterTable() string {
	var b strings.Builder
	b.WriteString("| key | type | default | range | unit | meaning |\n|---|---|---|---|---|---|\n")
	for _, k := range config.Keys {
		fmt.Fprintf(&b, "| %s | %s | %s | %s | %s | %s |\n", code(k.Path), k.Type, code(k.Default), cell(k.Range), cell(k.Unit), cell(k.Meaning))
	}
	return b.String()
}

// FlagTable renders a program's flags.
func FlagTable(flags []Flag) string {
	var b strings.Builder
	b.WriteString("| flag | type | default | meaning |\n|---|---|---|---|\n")
	for _, f := range flags {
		fmt.Fprintf(&b, "| %s | %s | %s | %s |\n", code("--"+f.Name), f.Type, code(f.Default), cell(f.Usage))
	}
	return b.String()
}

// Splice replaces the body of the named section of doc.
func Splice(doc, name, body string) (string, error) {
	begin, end := "<!-- BEGIN GENERATED "+name+" -->\n", "<!-- END GENERATED "+name+" -->"
	i := strings.Index(doc, begin)
	j := strings.Index(doc, end)
	if i < 0 || j < i {
		return "", fmt.Errorf("no %q … %q markers", strings.TrimSpace(begin), end)
	}
	return doc[:i+len(begin)] + body + doc[j:], nil
}

// Generate returns doc with every generated section rewritten; help holds
// each program's -h output by name.
func Generate(doc string, help map[string]string) (string, error) {
	doc, err := Splice(doc, FilterKeys, FilterTable())
	if err != nil {
		return "", err
	}
	for _, p := range Programs {
		h, ok := help[p.Name]
		if !ok {
			return "", fmt.Errorf("no -h output of %s", p.Name)
		}
		flags, err := ParseHelp(h)
		if err != nil {
			return "", fmt.Errorf("%s: %w", p.Name, err)
		}
		if doc, err = Splice(doc, p.Section, FlagTable(flags)); err != nil {
			return "", err
		}
	}
	return doc, nil
}
