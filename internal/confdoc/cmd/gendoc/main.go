// Command gendoc rewrites the generated tables of docs/configuration.md: the
// filter document's keys (filter/config.Keys) and the metadata center's and
// the worker's flags, read off the -h output of freshly built binaries. Run
// it from the repository root after changing a key or a flag:
//
//	. scripts/cgo-env.sh && go run ./internal/confdoc/cmd/gendoc
package main

import (
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"

	"github.com/istio-llm-filter/istio-llm-filter/internal/confdoc"
)

func main() {
	doc := flag.String("doc", "docs/configuration.md", "the page to rewrite")
	flag.Parse()
	if err := run(*doc); err != nil {
		slog.Error("gendoc", "err", err)
		os.Exit(1)
	}
}

func run(path string) error {
	bin, err := os.MkdirTemp("", "gendoc")
	if err != nil {
		return err
	}
	defer os.RemoveAll(bin)
	help := map[string]string{}
	for _, p := range confdoc.Programs {
		out := filepath.Join(bin, p.Name)
		build := exec.Command("go", "build", "-o", out, p.Package)
		build.Stdout, build.Stderr = os.Stderr, os.Stderr
		if err := build.Run(); err != nil {
			return fmt.Errorf("go build %s: %w", p.Package, err)
		}
		if help[p.Name], err = confdoc.Help(out); err != nil {
			return err
		}
	}
	old, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	doc, err := confdoc.Generate(string(old), help)
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if doc == string(old) {
		fmt.Println(path, "is up to date")
		return nil
	}
	if err := os.WriteFile(path, []byte(doc), 0o644); err != nil {
		return err
	}
	fmt.Println("rewrote", path)
	return nil
}
