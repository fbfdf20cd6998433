// Command ttftcmp measures time to first token of OpenAI-compatible servers
// side by side: this project's worker and, say, Ollama serving the same
// GGUF. Servers take turns (never two at once, so they do not compete for
// the CPU), every round uses prompts no server has seen, and the answer is
// a table of mean TTFT per scenario and server with the ratio to the first
// server. scripts/bench-ollama.sh starts the servers and runs it;
// docs/benchmarks.md has the figures.
//
// Scenarios:
//
//	cold      one request, a fresh ~cold-tokens prompt
//	shared    users requests 50 ms apart: one fresh ~system-tokens system
//	          prompt, each user's own question
//	distinct  users requests 50 ms apart, each a different ~system-tokens
//	          prompt
//
// Prompt sizes are in bytes of ASCII text, which is tokens on the generated
// models' byte-level vocabulary.
//
// With --pid name=PID (Linux) it also reports the CPU time the server's
// process tree (Ollama's runner is a child of `ollama serve`) spent on each
// round: on a machine shared with other work, wall-clock TTFT moves with the
// load, while the CPU seconds of single-threaded servers stay the work done.
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/client"
)

type target struct{ name, url, model string }

type targets []target

func (t *targets) String() string { return fmt.Sprint(*t) }

func (t *targets) Set(v string) error {
	f := strings.SplitN(v, "=", 3)
	if len(f) != 3 || f[0] == "" || !strings.HasPrefix(f[1], "http") || f[2] == "" {
		return fmt.Errorf("want name=http://host:port=model, got %q", v)
	}
	*t = append(*t, target{f[0], strings.TrimRight(f[1], "/"), f[2]})
	return nil
}

type pids map[string]int

func (p pids) String() string { return fmt.Sprint(map[string]int(p)) }

func (p pids) Set(v string) error {
	name, id, ok := strings.Cut(v, "=")
	n, err := strconv.Atoi(id)
	if !ok || name == "" || err != nil || n <= 0 {
		return fmt.Errorf("want name=PID, got %q", v)
	}
	p[name] = n
	return nil
}

type config struct {
	targets      targets
	pids         pids
	scenarios    []string
	rounds       int
	users        int
	gap          time.Duration
	systemTokens int
	coldTokens   int
	maxTokens    int
	timeout      time.Duration
}

func main() {
	c := config{pids: pids{}}
	var scen string
	flag.Var(&c.targets, "target", "name=base URL=model, repeatable; the first is the reference of the ratios")
	flag.Var(c.pids, "pid", "name=PID of a target's server process, repeatable: report its process tree's CPU time per round")
	flag.StringVar(&scen, "scenarios", "cold,shared,distinct", "comma-separated: cold, shared, distinct")
	flag.IntVar(&c.rounds, "rounds", 3, "rounds per scenario and server")
	flag.IntVar(&c.users, "users", 4, "users of the shared and distinct scenarios")
	flag.DurationVar(&c.gap, "gap", 50*time.Millisecond, "time between the users' requests")
	flag.IntVar(&c.systemTokens, "system-tokens", 2000, "size of the (shared or distinct) system prompt")
	flag.IntVar(&c.coldTokens, "cold-tokens", 2600, "size of the cold prompt")
	flag.IntVar(&c.maxTokens, "max-tokens", 8, "tokens to generate per request")
	flag.DurationVar(&c.timeout, "timeout", 10*time.Minute, "per request")
	flag.Parse()
	c.scenarios = strings.Split(scen, ",")
	if len(c.targets) == 0 || c.rounds < 1 || c.users < 1 {
		fmt.Fprintln(os.Stderr, "ttftcmp: at least one --target, --rounds and --users at least 1")
		os.Exit(2)
	}
	if err := run(context.Background(), c, os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "ttftcmp:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, c config, out io.Writer) error {
	cl := &client.Client{Timeout: c.timeout}
	for _, t := range c.targets { // loads the model (Ollama loads on first use)
		if _, err := ttft(ctx, cl, t, []client.Message{{Role: "user", Content: "warm up " + t.name}}, 2); err != nil {
			return fmt.Errorf("%s: warm-up: %w", t.name, err)
		}
	}
	means := map[string]map[string][]time.Duration{}
	cpu := map[string]map[string][]time.Duration{}
	for _, sc := range c.scenarios {
		means[sc] = map[string][]time.Duration{}
		cpu[sc] = map[string][]time.Duration{}
		for r := range c.rounds {
			for _, t := range c.targets {
				salt := fmt.Sprintf("%s round %d on %s at %d", sc, r, t.name, time.Now().UnixNano())
				convs, err := prompts(c, sc, salt)
				if err != nil {
					return err
				}
				pid := c.pids[t.name]
				before := treeCPU(pid)
				ds, err := users(ctx, cl, t, c, convs)
				if err != nil {
					return fmt.Errorf("%s %s round %d: %w", t.name, sc, r, err)
				}
				line := fmt.Sprintf("%-8s %-10s round %d: TTFT %v", sc, t.name, r, round(ds))
				if pid > 0 {
					used := treeCPU(pid) - before
					cpu[sc][t.name] = append(cpu[sc][t.name], used)
					line += fmt.Sprintf(", CPU %.2f s", used.Seconds())
				}
				fmt.Fprintln(os.Stderr, line)
				means[sc][t.name] = append(means[sc][t.name], ds...)
			}
		}
	}
	defer func() {
		if len(c.pids) == 0 {
			return
		}
		fmt.Fprintf(out, "\nCPU seconds of the server per round (mean), ratio to %s:\n\n", c.targets[0].name)
		fmt.Fprintf(out, "| scenario | %s |\n|---|%s\n", names(c.targets, " | "), strings.Repeat("---|", len(c.targets)))
		for _, sc := range c.scenarios {
			ref := mean(cpu[sc][c.targets[0].name])
			row := []string{}
			for i, t := range c.targets {
				ds := cpu[sc][t.name]
				if len(ds) == 0 {
					row = append(row, "")
					continue
				}
				cell := fmt.Sprintf("%.2f s", mean(ds).Seconds())
				if i > 0 && ref > 0 {
					cell += fmt.Sprintf(" (%.2f×)", float64(mean(ds))/float64(ref))
				}
				row = append(row, cell)
			}
			fmt.Fprintf(out, "| %s | %s |\n", sc, strings.Join(row, " | "))
		}
	}()
	fmt.Fprintf(out, "mean TTFT (median in brackets), ratio to %s:\n\n", c.targets[0].name)
	fmt.Fprintf(out, "| scenario | %s |\n|---|%s\n", names(c.targets, " | "), strings.Repeat("---|", len(c.targets)))
	for _, sc := range c.scenarios {
		ref := mean(means[sc][c.targets[0].name])
		row := []string{}
		for i, t := range c.targets {
			ds := means[sc][t.name]
			m := mean(ds)
			cell := fmt.Sprintf("%.2f s [%.2f]", m.Seconds(), median(ds).Seconds())
			if i > 0 && ref > 0 {
				cell += fmt.Sprintf(" (%.2f×)", float64(m)/float64(ref))
			}
			row = append(row, cell)
		}
		fmt.Fprintf(out, "| %s | %s |\n", sc, strings.Join(row, " | "))
	}
	return nil
}

// treeCPU is the user+system CPU time of pid and all its descendants, from
// /proc (0 when pid is 0 or /proc cannot be read).
func treeCPU(pid int) time.Duration {
	if pid <= 0 {
		return 0
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return 0
	}
	type proc struct{ ppid, ticks int }
	procs := map[int]proc{}
	for _, e := range ents {
		id, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// Fields after the command name, which is in parentheses and may
		// hold spaces: state ppid ... utime(14) stime(15).
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) < 13 {
			continue
		}
		ppid, _ := strconv.Atoi(f[1])
		ut, _ := strconv.Atoi(f[11])
		st, _ := strconv.Atoi(f[12])
		procs[id] = proc{ppid, ut + st}
	}
	total := 0
	var walk func(int)
	walk = func(p int) {
		total += procs[p].ticks
		for c, pr := range procs {
			if pr.ppid == p {
				walk(c)
			}
		}
	}
	walk(pid)
	// USER_HZ is 100 on every Linux the project runs on.
	return time.Duration(total) * 10 * time.Millisecond
}

func names(ts []target, sep string) string {
	var s []string
	for _, t := range ts {
		s = append(s, t.name)
	}
	return strings.Join(s, sep)
}

func round(ds []time.Duration) []time.Duration {
	out := make([]time.Duration, len(ds))
	for i, d := range ds {
		out[i] = d.Round(time.Millisecond)
	}
	return out
}

func mean(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	var s time.Duration
	for _, d := range ds {
		s += d
	}
	return s / time.Duration(len(ds))
}

func median(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// filler is n bytes of plain text that starts with salt, so no server has
// any of it cached.
func filler(salt string, n int) string {
	words := []string{"the", "router", "keeps", "every", "prefix", "of", "a", "long", "document", "in", "cache", "and",
		"sends", "each", "question", "to", "pod", "that", "holds", "it", "already", "so", "prefill", "is", "short"}
	var b strings.Builder
	b.WriteString(salt + ": ")
	for i := 0; b.Len() < n; i++ {
		b.WriteString(words[(i*7+len(salt))%len(words)])
		if i%11 == 10 {
			b.WriteString(".\n")
		} else {
			b.WriteByte(' ')
		}
	}
	return b.String()[:n]
}

func prompts(c config, sc, salt string) ([][]client.Message, error) {
	switch sc {
	case "cold":
		return [][]client.Message{{{Role: "user", Content: filler(salt, c.coldTokens)}}}, nil
	case "shared":
		sys := filler(salt, c.systemTokens)
		var out [][]client.Message
		for u := range c.users {
			out = append(out, []client.Message{{Role: "system", Content: sys}, {Role: "user", Content: fmt.Sprintf("User %d asks: what does line %d say?", u, u*7)}})
		}
		return out, nil
	case "distinct":
		var out [][]client.Message
		for u := range c.users {
			out = append(out, []client.Message{{Role: "system", Content: filler(fmt.Sprintf("user %d %s", u, salt), c.systemTokens)},
				{Role: "user", Content: fmt.Sprintf("User %d asks: what does line %d say?", u, u*7)}})
		}
		return out, nil
	}
	return nil, fmt.Errorf("unknown scenario %q", sc)
}

// users sends the conversations gap apart and returns their TTFTs.
func users(ctx context.Context, cl *client.Client, t target, c config, convs [][]client.Message) ([]time.Duration, error) {
	ds := make([]time.Duration, len(convs))
	errs := make([]error, len(convs))
	var wg sync.WaitGroup
	for i, m := range convs {
		if i > 0 {
			time.Sleep(c.gap)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			ds[i], errs[i] = ttft(ctx, cl, t, m, c.maxTokens)
		}()
	}
	wg.Wait()
	return ds, errors.Join(errs...)
}

// ttft streams one greedy chat completion and returns the time to its first
// token (bench/client: the first chunk carrying text or, when the first
// token ends the answer, as a random-weights model may pick
// end-of-generation at once, the finish reason); the stream is read to its
// end.
func ttft(ctx context.Context, cl *client.Client, t target, m []client.Message, maxTokens int) (time.Duration, error) {
	res := cl.Do(ctx, t.url, client.Request{Model: t.model, Messages: m, Stream: true, MaxTokens: maxTokens})
	switch {
	case res.Outcome != client.OK:
		return 0, errors.New(res.Err)
	case res.TTFT == 0:
		return 0, errors.New("no text arrived")
	}
	return res.TTFT, nil
}
