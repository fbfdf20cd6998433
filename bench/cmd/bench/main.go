// Command bench compares the filter's routing policies side by side in one
// run: for every workload and every policy it starts a fresh fleet (metadata
// center, N workers, standalone gateway) from the binaries in --bin, replays
// the same sessions through the gateway, and writes JSON, Markdown and SVG
// plots to --out.
//
//	make build && go run ./bench/cmd/bench --engine sim --workers 8 --out bench/out/sim
//	go run ./bench/cmd/bench --engine llama --workers 3 --model var/models/tiny.gguf --out bench/out/llama
//	go run ./bench/cmd/bench --engine vllm --workers 64 --workloads generated-shared-prefix,shared-prefix-ladder \
//	    --seeds 4,5,6 --repeats 5 --out bench/out/vllm
//
// With --seeds and --repeats every seed is run --repeats times, the
// policies one after the other each time (A B, then B A, …), and the report gives
// each cell's median with its range; results.json keeps every request
// (seed, repeat, ladder rate, predicted TTFT) so each figure can be derived
// again. shared-prefix-ladder runs once per --ladder rate and is reported as
// latency-against-load curves with each policy's saturation rate.
//
// A --policies entry may be a router of another make run in place of our
// gateway: sglang-router (the SGLang router from PyPI) or any --external
// one, started per run against that run's pods (external.go). Every report
// gives each workload's floor, the TTFT no router can beat (bench/floor).
package main

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/client"
	"github.com/istio-llm-filter/istio-llm-filter/bench/fleet"
	"github.com/istio-llm-filter/istio-llm-filter/bench/floor"
	"github.com/istio-llm-filter/istio-llm-filter/bench/loadgen"
	"github.com/istio-llm-filter/istio-llm-filter/bench/report"
	"github.com/istio-llm-filter/istio-llm-filter/bench/vllmsim"
	"github.com/istio-llm-filter/istio-llm-filter/bench/workload"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	var (
		bin         = fs.String("bin", "bin", "directory with the metadata-center, worker and gateway binaries (make build)")
		out         = fs.String("out", "bench/out/run", "output directory")
		engine      = fs.String("engine", "sim", "worker engine: sim (our worker, calibrated cost model), llama (our worker, real compute) or vllm (vLLM-like pods, bench/vllmsim, scraped by the metadata center)")
		workers     = fs.Int("workers", 8, "number of workers")
		model       = fs.String("model", "", "GGUF model (required for llama; gives sim its context size)")
		modelName   = fs.String("model-name", "tiny", "model name clients send")
		workerArgs  = fs.String("worker-args", "", "extra worker flags (vllm: vllmsim flags such as --max-num-seqs 8), space-separated")
		policies    = fs.String("policies", "cache_aware,epp,sglang,round_robin,random,least_request,prefix_only", "policies to compare (epp and sglang stand for llm-d's endpoint picker and SGLang's router inside our gateway; sglang-router runs the real SGLang router in its place, see --sglang-router-dir; --external adds others)")
		workloads   = fs.String("workloads", strings.Join(workload.Classic, ","), "workloads to run: "+strings.Join(workload.Kinds, ", "))
		concurrency = fs.Int("concurrency", 0, "sessions in flight at once (0: Poisson arrivals at --rate)")
		rate        = fs.Float64("rate", 2, "Poisson session arrival rate per second (when --concurrency is 0)")
		maxTokens   = fs.Int("max-tokens", 16, "output tokens per request (fixed with ignore_eos) where the workload sets none")
		seed        = fs.Uint64("seed", 1, "workload and arrival seed")
		seeds       = fs.String("seeds", "", "comma-separated seeds, each a round of its own (replaces --seed): 1-3 for development, 4 and up held out for verdicts")
		repeats     = fs.Int("repeats", 1, "runs of every policy per seed, interleaved (A B, B A, …); reports give the medians with the range")
		ladder      = fs.String("ladder", "2,4,8,16,32", workload.Ladder+": offered loads (requests/s) of its steps, increasing; a policy stops once TTFT p90 passes 2 s")
		ladderDur   = fs.Duration("ladder-duration", 30*time.Second, workload.Ladder+": each step sends rate × duration requests (at most the workload's)")
		workerCPUs  = fs.Float64("worker-cpus", 0, "CPU quota per worker via cgroups (e.g. 0.6), so that each pod has its own compute as on real accelerators (0: workers share the machine)")
		kvCells     = fs.Int("kv-cells", 0, "sim: KV cells per worker (its --n-ctx), small enough that caches fill and evict as on a busy GPU (0: the worker's default)")
		lbRule      = fs.String("lb-rule", "", `extra lb_mapping_rule keys for every policy, YAML flow style, e.g. "cache_ratio_weight: 4, prefill_load_weight: 1"`)
		gateways    = fs.Int("gateways", 1, "standalone gateways; clients round-robin requests over them")
		mcs         = fs.Int("metadata-centers", 1, "metadata-center replicas (more than one needs --store redis or redis-cluster)")
		store       = fs.String("store", "memory", "metadata-center store: memory, redis (one redis-server) or redis-cluster (3 masters + 3 replicas), started by the bench")
		queryTO     = fs.Duration("query-timeout", 0, "the gateways' metadata_center.query_timeout (0: the filter's default, 100ms)")
		topology    = fs.String("gateway", fleet.TopologyGateway, "how clients reach the workers: gateway (the standalone gateway), envoy-epp (the upstream Envoy, $LLMF_TEST_ENVOY, with our endpoint picker: bin/epp) or envoy-direct (that Envoy straight to the workers)")
		gwLog       = fs.String("gateway-log-level", "warn", "the gateways' log_level; debug logs every decision's per-scorer scores (logs/WORKLOAD/POLICY/gateway*.log)")
		merge       = fs.String("merge", "", "instead of running: join the outputs of earlier runs (comma-separated directories) into --out")
		spec        workload.Spec
		sglangDir   = fs.String("sglang-router-dir", "var/sglang-router", "where `pip install --target DIR sglang-router` put the SGLang router that the sglang-router entry of --policies runs (empty: python3's own packages)")
		variants    = variantFlag{}
		plans       = planFlag{}
		externals   = externalFlag{}
	)
	fs.Var(variants, "variant", `a named policy variant for --policies, "label=policy; rule keys" (repeatable; keys separated by commas, checked before anything starts), e.g. "ca-tie0=cache_aware; tie_epsilon: 0": an A/B of a policy against itself with other lb-rule keys in one run`)
	fs.Var(externals, "external", `a router of another make for --policies, in place of our gateway: "label=command" (repeatable), run by /bin/sh against each run's fresh pods with {workers} (their base URLs, space-separated; {workers_csv} comma-separated), {port} (where it must listen) and {metrics_port} substituted, e.g. "vllm-rr=vllm-router --worker-urls {workers} --policy round_robin --port {port}"; or "label=http://host:port", a router already running in front of pods of your own (no fleet is started for it). sglang-router needs no --external: it runs the SGLang router from --sglang-router-dir`)
	fs.Var(plans, "plan", `a fixed placement for --policies, "label=group:worker, ..." (repeatable), e.g. "halves=s0/u0:0, s0/u1:0, s1/u0:1, s1/u1:1": every session of a group goes straight to worker N (0-based, in start order), past the gateway, to measure what a placement gives beside the policies; it must name every group of the workloads it runs`)
	// Sizes default to 0: each workload's own defaults (workload.Spec.Defaults).
	fs.IntVar(&spec.Systems, "systems", 0, "shared-prefix / kv-pressure: system prompts (default 2 / 12)")
	fs.IntVar(&spec.Users, "users", 0, "shared-prefix / kv-pressure: users per system prompt (default 4 / 3)")
	fs.IntVar(&spec.Questions, "questions", 0, "shared-prefix: questions per user (default 32)")
	fs.IntVar(&spec.Sessions, "sessions", 0, "multi-turn: conversations (default 32)")
	fs.IntVar(&spec.Turns, "turns", 0, "multi-turn / kv-pressure: turns per conversation (default 12 / 8)")
	fs.IntVar(&spec.Requests, "requests", 0, "no-sharing / hot-prompt: requests (default 128)")
	fs.IntVar(&spec.SystemBytes, "system-bytes", 0, "system prompt bytes (= tokens on byte-level vocabularies); default 2048 shared-prefix, else 1024")
	fs.IntVar(&spec.UserBytes, "user-bytes", 0, "user history (shared-prefix, default 1024) / turn (multi-turn, default 256) bytes")
	fs.IntVar(&spec.QuestionBytes, "question-bytes", 0, "question bytes (default 64 shared-prefix, else 96)")
	fs.IntVar(&spec.SystemTokens, "system-tokens", 0, "standard workloads: system prompt tokens (default 2048, multi-turn-think 1024)")
	fs.IntVar(&spec.QuestionTokens, "question-tokens", 0, "generated-shared-prefix / shared-prefix-ladder: question tokens (default 128 / 256)")
	fs.IntVar(&spec.UserTokens, "user-tokens", 0, "multi-turn-think: tokens per user turn (default 128)")
	fs.IntVar(&spec.OutputTokens, "output-tokens", 0, "generated-shared-prefix / shared-prefix-ladder: output tokens per request (default 256)")
	fs.IntVar(&spec.OutputMin, "output-min", 0, "multi-turn-think: shortest answer in tokens (default 128)")
	fs.IntVar(&spec.OutputMax, "output-max", 0, "multi-turn-think: longest answer in tokens (default 512)")
	fs.DurationVar(&spec.ThinkTime, "think-time", 0, "multi-turn-think: mean pause between an answer and the next turn (default 3s)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *merge != "" {
		return mergeRuns(split(*merge), *out)
	}
	if *engine == "llama" && *model == "" {
		return fmt.Errorf("--engine llama needs --model")
	}
	// Parsed as the gateway parses its log_level, so a level is refused here
	// rather than by every gateway the run starts.
	var level slog.Level
	if err := level.UnmarshalText([]byte(*gwLog)); err != nil {
		return fmt.Errorf("--gateway-log-level: %w", err)
	}
	if err := plans.check(*workers); err != nil {
		return err
	}
	seedList, err := parseSeeds(*seeds, *seed)
	if err != nil {
		return err
	}
	ladderRates, err := parseRates(*ladder)
	if err != nil {
		return err
	}
	if *repeats < 1 {
		return fmt.Errorf("--repeats must be at least 1, got %d", *repeats)
	}
	spec.BytesPerToken = 1 // our workers' byte-level vocabulary
	wargs := strings.Fields(*workerArgs)
	switch *engine {
	case "sim", "llama":
		if *kvCells > 0 {
			wargs = append(wargs, "--n-ctx", fmt.Sprint(*kvCells))
		}
	case fleet.EngineVLLM:
		spec.BytesPerToken = vllmsim.BytesPerToken
		if *workerCPUs > 0 {
			return errors.New("--worker-cpus does not apply to --engine vllm: its pods share one process and sleep instead of computing")
		}
		if *kvCells > 0 {
			c := vllmsim.DefaultConfig()
			wargs = append(wargs, "--num-gpu-blocks", fmt.Sprint(*kvCells/c.BlockSize), "--max-model-len", fmt.Sprint(min(c.MaxModelLen, *kvCells)))
		}
	default:
		return fmt.Errorf("--engine %q: want sim, llama or %s", *engine, fleet.EngineVLLM)
	}
	title := fmt.Sprintf("Routing policies on %d %s workers", *workers, *engine)
	settings := map[string]string{
		"engine": *engine, "workers": fmt.Sprint(*workers), "max_tokens": fmt.Sprint(*maxTokens),
		"concurrency": fmt.Sprint(*concurrency), "rate": fmt.Sprint(*rate), "seeds": *seeds, "repeats": fmt.Sprint(*repeats),
		"worker_args": *workerArgs, "kv_cells": fmt.Sprint(*kvCells), "model": *model, "lb_rule": *lbRule, "worker_cpus": fmt.Sprint(*workerCPUs),
		"variants": variants.String(), "plans": plans.String(), "gateways": fmt.Sprint(*gateways), "metadata_centers": fmt.Sprint(*mcs), "store": *store,
		"query_timeout": queryTO.String(), "bytes_per_token": fmt.Sprint(spec.BytesPerToken),
	}
	if len(externals) > 0 {
		settings["externals"] = externals.String()
	}
	if slices.Contains(split(*policies), sglangRouter) {
		settings[sglangRouter] = sglangRouterCommand + " (PYTHONPATH " + *sglangDir + ")"
	}
	if settings["seeds"] == "" {
		settings["seeds"] = fmt.Sprint(*seed)
	}
	if *engine == fleet.EngineVLLM {
		settings["scrape_interval"] = fleet.ScrapeInterval.String()
	}
	if slices.Contains(split(*workloads), workload.Ladder) {
		settings["ladder"], settings["ladder_duration"] = *ladder, ladderDur.String()
	}
	machine := map[string]string{"cpus": fmt.Sprint(runtime.NumCPU()), "os": runtime.GOOS + "/" + runtime.GOARCH, "go": runtime.Version()}
	started := time.Now().UTC().Format(time.RFC3339)
	// One round per seed and repeat: the policies of a round run one after
	// the other on the same sessions, in the given order in even rounds and
	// reversed in odd ones (roundOrder).
	rounds := make([]report.Run, len(seedList)**repeats)
	for i := range rounds {
		sd, rep := seedList[i / *repeats], i%*repeats+1
		rounds[i] = report.Run{Title: title, Started: started, Machine: machine, Settings: maps.Clone(settings),
			Label: fmt.Sprintf("seed %d, repeat %d", sd, rep)}
		rounds[i].Settings["seed"] = fmt.Sprint(sd)
	}
	joint := func() report.Run {
		if len(rounds) == 1 {
			return rounds[0]
		}
		m := report.Merge(rounds...)
		m.Started, m.Settings["seed"] = started, settings["seeds"]
		return m
	}
	var raw []report.Result
	pols := split(*policies)
	wls := split(*workloads)
	for _, p := range pols {
		if _, ext, err := externals.resolve(p, *sglangDir); err != nil || ext {
			if err != nil {
				return fmt.Errorf("--policies %s: %w", p, err)
			}
			continue
		}
		policy, rule := variants.resolve(p, *lbRule)
		if err := fleet.CheckRule(fleet.Spec{ModelName: *modelName, Policy: policy, LBRule: rule}); err != nil {
			return fmt.Errorf("--policies %s: %w", p, err)
		}
	}
	floorModel, noFloor, err := floor.For(*engine, wargs, *model)
	if err != nil {
		return err
	}
	for i := range rounds {
		rounds[i].NoFloor = noFloor
	}
	cells := 0
	for _, wl := range wls {
		if wl == workload.Ladder {
			cells += len(ladderRates)
		} else {
			cells++
		}
	}
	step, steps := 0, cells*len(pols)*len(rounds)
	ttfts := map[string]map[string][]float64{} // cell → policy → TTFTs (ms)
	for _, wl := range wls {
		// A ladder runs the workload at each rate; anything else once at --rate.
		rates := []float64{0}
		if wl == workload.Ladder {
			rates = ladderRates
		}
		for si, sd := range seedList {
			s := spec
			s.Kind, s.Seed = wl, sd
			sessions, err := workload.Generate(s)
			if err != nil {
				return err
			}
			saturated := map[string]bool{} // repeat/policy past the ladder's limit
			floorFrom := map[string]int{}  // cell/repeat → requests its floor was computed from
			for _, lr := range rates {
				cell, arrival, cellSessions := wl, *rate, sessions
				if lr > 0 {
					cell, arrival = report.LadderStep(wl, lr), lr
					cellSessions = sessions[:min(len(sessions), max(1, int(math.Ceil(lr*ladderDur.Seconds()))))]
				}
				if ttfts[cell] == nil {
					ttfts[cell] = map[string][]float64{}
				}
				for rep := 1; rep <= *repeats; rep++ {
					round := &rounds[si**repeats+rep-1]
					for _, p := range roundOrder(pols, si**repeats+rep-1) {
						step++
						label := fmt.Sprintf("[%d/%d] %s × %s (seed %d, repeat %d)", step, steps, cell, p, sd, rep)
						key := fmt.Sprintf("%d/%s", rep, p)
						if saturated[key] {
							fmt.Fprintf(os.Stderr, "%s: skipped, saturated at a lower rate\n", label)
							continue
						}
						policy, rule := variants.resolve(p, *lbRule)
						plan, planned := plans[p]
						if planned {
							if err := plan.covers(cellSessions); err != nil {
								return fmt.Errorf("%s: %w", label, err)
							}
							policy = "round_robin" // the gateway runs but takes no request
						}
						ext, isExt, _ := externals.resolve(p, *sglangDir) // checked above
						bases, podAddrs, stop := []string{ext.url}, []string(nil), func() {}
						if ext.url == "" {
							f, err := fleet.Start(ctx, fleet.Spec{
								BinDir: *bin, LogDir: filepath.Join(*out, "logs", cell, p, fmt.Sprintf("seed%d-r%d", sd, rep)), Engine: *engine, Workers: *workers,
								Model: *model, ModelName: *modelName, Policy: policy, LBRule: rule, WorkerCPUs: *workerCPUs, WorkerArgs: wargs,
								Gateways: *gateways, MetadataCenters: *mcs, Store: *store, QueryTimeout: *queryTO,
								GatewayLogLevel: *gwLog, Topology: *topology, NoGateway: isExt,
							})
							if err != nil {
								return fmt.Errorf("%s: %w", label, err)
							}
							if isExt {
								if _, err := f.StartRouter(ctx, ext.cmd); err != nil {
									f.Stop()
									return fmt.Errorf("%s: %w", label, err)
								}
							}
							bases, podAddrs, stop = f.Gateways, f.Workers, f.Stop
						}
						var sentMu sync.Mutex
						var sent []sentRequest
						t0 := time.Now()
						rs := loadgen.Run(ctx, cellSessions, loadgen.Options{
							BaseURLs: bases, Model: *modelName, MaxTokens: *maxTokens,
							Concurrency: *concurrency, Rate: arrival, Seed: sd, Plan: plan.addresses(podAddrs),
							Progress: func(done, total int) {
								fmt.Fprintf(os.Stderr, "\r%s: %d/%d requests, %.0fs   ", label, done, total, time.Since(t0).Seconds())
							},
							Sent: func(r report.Result, msgs []client.Message, answer string) {
								if r.OK() {
									sentMu.Lock()
									sent = append(sent, sentRequest{r.Start, msgs, answer})
									sentMu.Unlock()
								}
							},
						})
						stop()
						// The floor comes from the run that completed the most
						// requests of the cell (the engines answer the same
						// prompts alike, so every complete run gives the same),
						// never from a router in front of pods of its own.
						if fk := fmt.Sprintf("%s/%d", cell, rep); floorModel != nil && ext.url == "" && len(sent) > floorFrom[fk] {
							fl, err := floorOf(floorModel, cell, sent, *workers)
							if err != nil {
								return fmt.Errorf("%s: floor: %w", label, err)
							}
							floorFrom[fk] = len(sent)
							round.SetFloor(fl)
						}
						for i := range rs {
							rs[i].Workload, rs[i].Policy, rs[i].Seed, rs[i].Repeat, rs[i].Rate = cell, p, sd, rep, lr
							if rs[i].OK() && rs[i].TTFT > 0 {
								ttfts[cell][p] = append(ttfts[cell][p], float64(rs[i].TTFT)/float64(time.Millisecond))
							}
						}
						raw = append(raw, rs...)
						sum := report.Summarize(cell, p, rs, podAddrs)
						sum.Rate, sum.External = lr, isExt
						round.Summaries = append(round.Summaries, sum)
						if lr > 0 && sum.TTFT.P90 > report.SaturationP90 {
							saturated[key] = true
						}
						imb := fmt.Sprintf("%.2f", sum.Imbalance)
						if sum.UpstreamUnknown {
							imb = "unknown"
						}
						fmt.Fprintf(os.Stderr, "\r%s: TTFT p90 %.1f ms, success %.0f%%, cache hit %.0f%%, imbalance %s\n",
							label, sum.TTFT.P90, 100*sum.SuccessRate, 100*sum.CacheHitRate, imb)
						// Rewrite every output after each pair: a long real-compute run
						// can be read (and survives an interrupt) while it goes on.
						if err := writeOutputs(*out, joint(), raw); err != nil {
							return err
						}
						if err := writeFile(filepath.Join(*out, "ttft_cdf_"+cell+".svg"), func(w *os.File) error {
							return report.CDF(w, "TTFT distribution — "+cell, "TTFT (ms)", ttfts[cell], pols)
						}); err != nil {
							return err
						}
						if ctx.Err() != nil {
							return ctx.Err()
						}
					}
				}
			}
		}
	}
	fmt.Fprintf(os.Stderr, "wrote %s/{report.md,summary.json,results.json,*.svg}\n", *out)
	return nil
}

// sentRequest is one successful request as a run sent it, for the floor.
type sentRequest struct {
	start  time.Duration
	msgs   []client.Message
	answer string
}

// floorOf computes a cell's floor and its fleet's capacity bound from one
// run's requests, in the order they were sent.
func floorOf(e floor.Engine, cell string, sent []sentRequest, pods int) (report.Floor, error) {
	slices.SortStableFunc(sent, func(a, b sentRequest) int { return cmp.Compare(a.start, b.start) })
	reqs := make([]floor.Request, len(sent))
	for i, s := range sent {
		ms := make([]floor.Message, len(s.msgs))
		for j, m := range s.msgs {
			ms[j] = floor.Message{Role: m.Role, Content: m.Content}
		}
		reqs[i] = floor.Request{Messages: ms, Answer: s.answer}
	}
	b, err := floor.Bounds(e, reqs, pods)
	if err != nil {
		return report.Floor{}, err
	}
	f := report.NewFloor(cell, b.TTFTs)
	f.Capacity = b.Capacity
	return f, nil
}

// mergeRuns joins the summaries and per-request results of earlier runs and
// writes the joint report, tables and bar charts (the CDFs stay per run).
func mergeRuns(dirs []string, out string) error {
	var runs []report.Run
	var raw []report.Result
	for _, d := range dirs {
		var r report.Run
		var rs []report.Result
		if err := readJSON(filepath.Join(d, "summary.json"), &r); err != nil {
			return err
		}
		if err := readJSON(filepath.Join(d, "results.json"), &rs); err != nil {
			return err
		}
		runs, raw = append(runs, r), append(raw, rs...)
	}
	if err := writeOutputs(out, report.Merge(runs...), raw); err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "merged %d runs into %s\n", len(runs), out)
	return nil
}

func readJSON(path string, v any) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}

func writeOutputs(out string, run report.Run, raw []report.Result) error {
	files := map[string]func(*os.File) error{
		"summary.json": func(w *os.File) error { return run.WriteJSON(w) },
		"results.json": func(w *os.File) error { return json.NewEncoder(w).Encode(raw) },
		"report.md":    func(w *os.File) error { return run.WriteMarkdown(w) },
		"ttft_p90.svg": func(w *os.File) error {
			return run.BarChart(w, "TTFT p90 by workload and policy", "ms", func(s report.Summary) float64 { return s.TTFT.P90 })
		},
		"cache_hit.svg": func(w *os.File) error {
			return run.BarChart(w, "True cache-hit rate (cached_tokens / prompt_tokens)", "%", func(s report.Summary) float64 { return 100 * s.CacheHitRate })
		},
	}
	if len(run.Repeats) > 1 {
		files["paired_ttft_p90.svg"] = func(w *os.File) error {
			return run.PairedChart(w, "TTFT p90: cache_aware against each policy, run by run", func(s report.Summary) float64 { return s.TTFT.P90 })
		}
		files["paired_ttft_p99.svg"] = func(w *os.File) error {
			return run.PairedChart(w, "TTFT p99: cache_aware against each policy, run by run", func(s report.Summary) float64 { return s.TTFT.P99 })
		}
	}
	for _, base := range run.Ladders() {
		files["ladder_"+base+".svg"] = func(w *os.File) error { return run.LadderChart(w, base) }
	}
	for name, write := range files {
		if err := writeFile(filepath.Join(out, name), write); err != nil {
			return err
		}
	}
	return nil
}

func writeFile(path string, write func(*os.File) error) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := write(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// roundOrder is the order the policies run in round i: as given in even
// rounds, reversed in odd ones (A B, B A, …), so that what the machine does
// between the first and the last run of a round (a cache warming, a
// neighbour's load) falls on every policy alike over the rounds.
func roundOrder(pols []string, i int) []string {
	if i%2 == 0 {
		return pols
	}
	r := slices.Clone(pols)
	slices.Reverse(r)
	return r
}

// parseSeeds reads --seeds, or returns --seed alone when it is empty.
func parseSeeds(list string, single uint64) ([]uint64, error) {
	if strings.TrimSpace(list) == "" {
		return []uint64{single}, nil
	}
	var out []uint64
	for _, f := range split(list) {
		v, err := strconv.ParseUint(f, 10, 64)
		if err != nil || v == 0 {
			return nil, fmt.Errorf("--seeds: %q is not a positive integer", f)
		}
		if slices.Contains(out, v) {
			return nil, fmt.Errorf("--seeds: %d twice", v)
		}
		out = append(out, v)
	}
	return out, nil
}

// parseRates reads --ladder: positive, strictly increasing rates.
func parseRates(list string) ([]float64, error) {
	var out []float64
	for _, f := range split(list) {
		v, err := strconv.ParseFloat(f, 64)
		if err != nil || !(v > 0) || math.IsInf(v, 0) {
			return nil, fmt.Errorf("--ladder: %q is not a positive rate", f)
		}
		if len(out) > 0 && v <= out[len(out)-1] {
			return nil, fmt.Errorf("--ladder: rates must increase (%g after %g)", v, out[len(out)-1])
		}
		out = append(out, v)
	}
	if len(out) == 0 {
		return nil, errors.New("--ladder: no rate")
	}
	return out, nil
}

func split(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// variantFlag maps a label of --policies to a policy and extra lb-rule keys.
type variantFlag map[string][2]string

func (v variantFlag) String() string {
	parts := make([]string, 0, len(v))
	for label, pr := range v {
		parts = append(parts, label+"="+pr[0]+"; "+pr[1])
	}
	return strings.Join(parts, " | ")
}

func (v variantFlag) Set(s string) error {
	label, def, ok := strings.Cut(s, "=")
	label, def = strings.TrimSpace(label), strings.TrimSpace(def)
	if !ok || label == "" || def == "" {
		return fmt.Errorf(`want "label=policy; rule keys", got %q`, s)
	}
	policy, rule, _ := strings.Cut(def, ";")
	if policy = strings.TrimSpace(policy); policy == "" {
		return fmt.Errorf("variant %q names no policy", label)
	}
	v[label] = [2]string{policy, strings.TrimSpace(rule)}
	return nil
}

// resolve returns the policy and lb-rule keys of a --policies entry: a
// variant's own keys come after the global --lb-rule, so they win.
func (v variantFlag) resolve(name, global string) (policy, rule string) {
	pr, ok := v[name]
	if !ok {
		return name, global
	}
	switch {
	case global == "":
		return pr[0], pr[1]
	case pr[1] == "":
		return pr[0], global
	}
	return pr[0], global + ", " + pr[1]
}

// planFlag maps a label of --policies to a fixed placement.
type planFlag map[string]plan

// plan maps session groups to worker indexes.
type plan map[string]int

func (v planFlag) String() string {
	parts := make([]string, 0, len(v))
	for label, p := range v {
		parts = append(parts, fmt.Sprintf("%s=%v", label, map[string]int(p)))
	}
	return strings.Join(parts, " | ")
}

func (v planFlag) Set(s string) error {
	label, def, ok := strings.Cut(s, "=")
	label = strings.TrimSpace(label)
	if !ok || label == "" {
		return fmt.Errorf(`want "label=group:worker, ...", got %q`, s)
	}
	p := plan{}
	for _, e := range split(def) {
		group, w, ok := strings.Cut(e, ":")
		n, err := strconv.Atoi(strings.TrimSpace(w))
		if group = strings.TrimSpace(group); !ok || group == "" || err != nil || n < 0 {
			return fmt.Errorf("plan %q: want group:worker, got %q", label, e)
		}
		p[group] = n
	}
	if len(p) == 0 {
		return fmt.Errorf("plan %q places no group", label)
	}
	v[label] = p
	return nil
}

// check refuses a plan naming a worker the fleet will not have.
func (v planFlag) check(workers int) error {
	for label, p := range v {
		for group, n := range p {
			if n >= workers {
				return fmt.Errorf("plan %q puts %s on worker %d of %d", label, group, n, workers)
			}
		}
	}
	return nil
}

// covers refuses a plan that leaves some session's group to the gateway.
func (p plan) covers(sessions []workload.Session) error {
	var missing []string
	seen := map[string]bool{}
	for _, s := range sessions {
		if _, ok := p[s.Group]; !ok && !seen[s.Group] {
			seen[s.Group] = true
			missing = append(missing, strconv.Quote(s.Group))
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("the plan places no session of group %s", strings.Join(missing, ", "))
	}
	return nil
}

// addresses maps the plan's groups to the workers' addresses (nil for no plan).
func (p plan) addresses(workers []string) map[string]string {
	if p == nil {
		return nil
	}
	m := make(map[string]string, len(p))
	for group, n := range p {
		m[group] = workers[n]
	}
	return m
}
