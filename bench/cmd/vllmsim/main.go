// Command vllmsim serves simulated vLLM pods (bench/vllmsim), one per
// --listen address, all in this one process: the bench's `--engine vllm`
// fleet.
//
//	vllmsim --listen 127.0.0.1:8001,127.0.0.1:8002 --model-name tiny
//	vllmsim --pods 64 --listen 127.0.0.1:0 --addr-file pods.txt
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"slices"
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
	listen := fs.String("listen", "127.0.0.1:8000", "comma-separated addresses: one pod on each (port 0: any free port)")
	pods := fs.Int("pods", 0, "if > 0: this many pods, each on a free port of --listen's host (its first address)")
	addrFile := fs.String("addr-file", "", "write the pods' addresses, one a line, to this file once all listen (so a caller needs no free ports of its own)")
	c.RegisterFlags(fs)
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
	addrs := strings.Split(*listen, ",")
	if *pods > 0 {
		host, _, err := net.SplitHostPort(strings.TrimSpace(addrs[0]))
		if err != nil {
			return fmt.Errorf("--listen: %w", err)
		}
		addrs = slices.Repeat([]string{net.JoinHostPort(host, "0")}, *pods)
	}
	var bound []string
	for _, a := range addrs {
		l, err := net.Listen("tcp", strings.TrimSpace(a))
		if err != nil {
			return err
		}
		ls, bound = append(ls, l), append(bound, l.Addr().String())
	}
	if *addrFile != "" {
		// Written whole, then renamed: a reader never sees half a list.
		tmp := *addrFile + ".tmp"
		if err := os.WriteFile(tmp, []byte(strings.Join(bound, "\n")+"\n"), 0o644); err != nil {
			return err
		}
		if err := os.Rename(tmp, *addrFile); err != nil {
			return err
		}
	}
	return vllmsim.Serve(ctx, c, ls, log)
}
