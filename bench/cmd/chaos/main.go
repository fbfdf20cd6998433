// Command chaos runs the fault schedule under load, or the soak, on a
// fleet of real processes (docs/operations.md, "Chaos and soak"):
//
//	make chaos                      # the fault schedule, a few minutes
//	make soak SOAK_DURATION=30m     # steady load, processes sampled
//
// It exits 1 when an aim is missed (chaos) or a series grows without
// bound (soak), 2 when the run itself failed.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/chaos"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	code, err := run(ctx, os.Args[1:])
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaos:", err)
	}
	os.Exit(code)
}

func run(ctx context.Context, args []string) (int, error) {
	fs := flag.NewFlagSet("chaos", flag.ContinueOnError)
	var cfg chaos.Config
	render := fs.String("render", "", "instead of running: rewrite the report and plots of the chaos run in this directory")
	soak := fs.Bool("soak", false, "run the soak instead of the fault schedule")
	faults := fs.String("faults", strings.Join(chaos.FaultNames, ","), "faults to inject, in order (none: load only)")
	workerArgs := fs.String("worker-args", "", "more flags for every worker, space-separated")
	noLlama := fs.Bool("no-llama", false, "simulated workers only (drops the slow-worker fault)")
	fs.StringVar(&cfg.Bin, "bin", "bin", "directory with metadata-center, worker and gateway (make build)")
	fs.StringVar(&cfg.Out, "out", "bench/out/chaos", "output directory")
	fs.StringVar(&cfg.Model, "model", "var/models/tiny.gguf", "GGUF model of the llama worker (and the sim workers' sizes)")
	fs.IntVar(&cfg.SimWorkers, "sim-workers", 3, "simulated workers")
	fs.Float64Var(&cfg.LlamaCPUs, "llama-cpus", 1, "the llama worker's CPU quota (the slow-worker fault divides it by 10); negative: none (drops the slow-worker fault)")
	fs.IntVar(&cfg.Users, "users", 6, "concurrent users of the steady load")
	fs.Float64Var(&cfg.StreamShare, "stream-share", 0.5, "share of the users' requests sent streamed (the rest whole; negative: none)")
	fs.IntVar(&cfg.MaxTokens, "max-tokens", 32, "output tokens per request")
	fs.IntVar(&cfg.WorkerQueue, "worker-queue", 8, "every worker's --max-queue")
	fs.IntVar(&cfg.WorkerRunning, "worker-running", 4, "every worker's --max-concurrent-requests")
	fs.IntVar(&cfg.Burst, "burst", 96, "requests of the burst fault")
	fs.DurationVar(&cfg.LeaseTTL, "lease-ttl", 5*time.Second, "the metadata center's --lease-ttl")
	fs.DurationVar(&cfg.Baseline, "baseline", 20*time.Second, "plain load before the first fault")
	fs.DurationVar(&cfg.Gap, "gap", 15*time.Second, "recovery to next fault")
	fs.DurationVar(&cfg.SoakDuration, "duration", 30*time.Minute, "soak length")
	fs.DurationVar(&cfg.SampleEvery, "sample-every", 5*time.Second, "soak sampling period")
	fs.Uint64Var(&cfg.Seed, "seed", 1, "workload seed")
	if err := fs.Parse(args); err != nil {
		return 2, err
	}
	cfg.Llama = !*noLlama
	cfg.WorkerArgs = strings.Fields(*workerArgs)
	cfg.Progress = os.Stderr
	cfg.Faults = []string{}
	for _, f := range strings.Split(*faults, ",") {
		if f == "none" {
			break
		}
		if f = strings.TrimSpace(f); f != "" && !(f == "slow-worker" && (!cfg.Llama || cfg.LlamaCPUs < 0)) {
			cfg.Faults = append(cfg.Faults, f)
		}
	}
	if *render != "" {
		res, err := chaos.Render(*render)
		if err != nil {
			return 2, err
		}
		_ = res.WriteMarkdown(os.Stdout)
		return 0, nil
	}
	if *soak {
		res, err := chaos.RunSoak(ctx, cfg)
		if err != nil {
			return 2, err
		}
		_ = res.WriteMarkdown(os.Stdout)
		if g := res.Grows(); len(g) > 0 {
			return 1, fmt.Errorf("grows without bound: %s", strings.Join(g, ", "))
		}
		return 0, nil
	}
	res, err := chaos.RunChaos(ctx, cfg)
	if err != nil {
		return 2, err
	}
	_ = res.WriteMarkdown(os.Stdout)
	if !res.AimsMet() {
		return 1, fmt.Errorf("an aim was missed (%s/report.md)", cfg.Out)
	}
	return 0, nil
}
