// Command mkmodel writes a deterministic random-weights llama GGUF with a
// byte-level vocabulary: the model tests, benchmarks and the local stack run
// on, since no model can be downloaded here.
//
//	go run ./worker/cmd/mkmodel --out var/models/tiny.gguf [--preset tiny|bench] [--seed N] [--lora-out PATH]
//
// --lora-out also writes a LoRA adapter for the model (worker --lora name=PATH).
package main

import (
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/worker/ggufgen"
)

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "mkmodel:", err)
		os.Exit(2)
	}
}

func run(args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("mkmodel", flag.ContinueOnError)
	fs.SetOutput(stderr)
	out := fs.String("out", "", "path of the GGUF file to write (required)")
	preset := fs.String("preset", "tiny", "model shape: "+strings.Join(ggufgen.PresetNames(), "|"))
	seed := fs.Uint64("seed", ggufgen.DefaultSeed, "random seed; the same seed gives a byte-identical file")
	quiet := fs.Bool("quiet", false, "do not print progress")
	chatTemplate := fs.String("chat-template", "", "file of a Jinja chat template to store as tokenizer.chat_template (default: ChatML)")
	loraOut := fs.String("lora-out", "", "also write a LoRA adapter for this model to this path")
	loraSeed := fs.Uint64("lora-seed", 7, "random seed of the adapter's weights")
	loraRank := fs.Int("lora-rank", 8, "rank of the adapter")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if *out == "" {
		return fmt.Errorf("--out is required")
	}
	p, err := ggufgen.PresetByName(*preset)
	if err != nil {
		return err
	}

	if err := os.MkdirAll(filepath.Dir(*out), 0o755); err != nil {
		return err
	}
	start := time.Now()
	lastPct := -1
	opts := ggufgen.Options{Preset: p, Seed: *seed}
	if *chatTemplate != "" {
		b, err := os.ReadFile(*chatTemplate)
		if err != nil {
			return err
		}
		opts.ChatTemplate = string(b)
	}
	if !*quiet {
		fmt.Fprintf(stdout, "mkmodel: %s preset (%d layers, %d wide, %d heads/%d kv, ctx %d, %s) seed %d -> %s\n",
			p.Name, p.Layers, p.Embed, p.Heads, p.KVHeads, p.ContextLength, p.Weights, *seed, *out)
		opts.Progress = func(pr ggufgen.Progress) {
			pct := int(100 * pr.Done / max(pr.Total, 1))
			// Every 10%: enough to see it move without flooding CI logs.
			if pct/10 != lastPct/10 || pr.Done == pr.Total && pct != lastPct {
				lastPct = pct
				fmt.Fprintf(stdout, "mkmodel: %3d%% (%.1f/%.1f MiB)\n", pct, mib(pr.Done), mib(pr.Total))
			}
		}
	}
	if err := ggufgen.WriteFile(*out, opts); err != nil {
		return err
	}
	if *loraOut != "" {
		if err := os.MkdirAll(filepath.Dir(*loraOut), 0o755); err != nil {
			return err
		}
		if err := ggufgen.WriteLoRAFile(*loraOut, ggufgen.LoRAOptions{Preset: p, Seed: *loraSeed, Rank: *loraRank}); err != nil {
			return err
		}
		if !*quiet {
			fmt.Fprintf(stdout, "mkmodel: wrote LoRA adapter %s (rank %d, seed %d)\n", *loraOut, *loraRank, *loraSeed)
		}
	}
	if !*quiet {
		st, err := os.Stat(*out)
		if err != nil {
			return err
		}
		fmt.Fprintf(stdout, "mkmodel: wrote %s (%.1f MiB, id %s) in %s\n",
			*out, mib(st.Size()), p.ID(*seed), time.Since(start).Round(time.Millisecond))
	}
	return nil
}

func mib(n int64) float64 { return float64(n) / (1 << 20) }
