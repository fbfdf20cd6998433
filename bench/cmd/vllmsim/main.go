// Command vllmsim serves simulated vLLM pods (bench/vllmsim), one per
// --listen address, all in this one process: the bench's `--engine vllm`
// fleet.
//
//	vllmsim --listen 127.0.0.1:8001,127.0.0.1:8002 --model-name tiny
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/istio-llm-filter/istio-llm-filter/bench/vllmsim"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	if err := run(ctx, os.Args[1:], log); err != nil {
		fmt.Fprintln(os.Stderr, "vllmsim:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, log *slog.Logger) error {
	c := vllmsim.DefaultConfig()
	fs := flag.NewFlagSet("vllmsim", flag.ContinueOnError)
	listen := fs.String("listen", "127.0.0.1:8000", "comma-separated addresses: one pod on each")
	fs.StringVar(&c.ModelName, "model-name", c.ModelName, "the model name the pods serve")
	fs.IntVar(&c.BlockSize, "block-size", c.BlockSize, "tokens per KV block")
	fs.IntVar(&c.NumBlocks, "num-gpu-blocks", c.NumBlocks, "KV cache size in blocks")
	fs.IntVar(&c.MaxNumSeqs, "max-num-seqs", c.MaxNumSeqs, "running requests at most")
	fs.IntVar(&c.MaxNumBatchedTokens, "max-num-batched-tokens", c.MaxNumBatchedTokens, "token budget of one step (the prefill chunk)")
	fs.IntVar(&c.MaxModelLen, "max-model-len", c.MaxModelLen, "prompt plus output tokens at most")
	fs.DurationVar(&c.StepTime, "step-time", c.StepTime, "fixed time of one engine step")
	fs.DurationVar(&c.PrefillPerToken, "prefill-per-token", c.PrefillPerToken, "step time per prefill token")
	fs.DurationVar(&c.DecodePerSeq, "decode-per-seq", c.DecodePerSeq, "step time per decoding sequence")
	fs.IntVar(&c.StreamInterval, "stream-interval", c.StreamInterval, "tokens per streamed chunk after the first")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if err := c.Validate(); err != nil {
		return err
	}
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	for _, a := range strings.Split(*listen, ",") {
		l, err := net.Listen("tcp", strings.TrimSpace(a))
		if err != nil {
			return err
		}
		ls = append(ls, l)
	}
	return vllmsim.Serve(ctx, c, ls, log)
}
