package main

import (
	"cmp"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/istio-llm-filter/istio-llm-filter/bench/fleet"
)

// sglangRouter is the --policies entry that runs the real SGLang router
// (PyPI sglang-router) against each run's fresh pods, with its defaults
// (docs/benchmarks.md, "Fleets"): its cache_aware policy, cache_threshold
// 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5, a character
// radix tree per worker. Only where it listens is set: loopback, a free
// port, and a free port for its Prometheus listener (default 29000, which
// two routers at once would both want).
const sglangRouter = "sglang-router"

const sglangRouterCommand = "python3 -m sglang_router.launch_router --worker-urls {workers} --policy cache_aware" +
	" --host 127.0.0.1 --port {port} --prometheus-port {metrics_port}"

// external is a router of another make in place of our gateway: a command
// the bench starts against each run's fresh pods, or the URL of one
// already running, which the bench only sends to.
type external struct {
	url string // an already-running router: no fleet is started for it
	cmd fleet.RouterCommand
}

// externalFlag maps a label of --policies to an external router.
type externalFlag map[string]external

func (v externalFlag) String() string {
	parts := make([]string, 0, len(v))
	for label, e := range v {
		parts = append(parts, label+"="+cmp.Or(e.url, e.cmd.Command))
	}
	return strings.Join(parts, " | ")
}

func (v externalFlag) Set(s string) error {
	label, def, ok := strings.Cut(s, "=")
	label, def = strings.TrimSpace(label), strings.TrimSpace(def)
	if !ok || label == "" || def == "" {
		return fmt.Errorf(`want "label=http://host:port" or "label=command … {workers} … {port}", got %q`, s)
	}
	if strings.ContainsAny(label, `/\ `) {
		return fmt.Errorf("external router %q: a label names log files, it cannot hold / or spaces", label)
	}
	if (strings.HasPrefix(def, "http://") || strings.HasPrefix(def, "https://")) && !strings.ContainsAny(def, " {") {
		v[label] = external{url: strings.TrimSuffix(def, "/")}
		return nil
	}
	if !strings.Contains(def, "{port}") || !strings.Contains(def, "{workers") {
		return fmt.Errorf("external router %q: the command needs {workers} (or {workers_csv}) and {port}, got %q", label, def)
	}
	v[label] = external{cmd: fleet.RouterCommand{Name: label, Command: def}}
	return nil
}

// resolve returns the external router of a --policies entry: one of
// --external, or sglang-router (installed under dir by pip), or false for
// a policy of our gateway.
func (v externalFlag) resolve(name, sglangDir string) (external, bool, error) {
	if e, ok := v[name]; ok {
		return e, true, nil
	}
	if name != sglangRouter {
		return external{}, false, nil
	}
	e := external{cmd: fleet.RouterCommand{Name: sglangRouter, Command: sglangRouterCommand}}
	if sglangDir != "" {
		abs, err := filepath.Abs(sglangDir)
		if err != nil {
			return external{}, false, err
		}
		if _, err := os.Stat(filepath.Join(abs, "sglang_router", "launch_router.py")); err != nil {
			return external{}, false, fmt.Errorf("%s: no sglang_router package under %s; install it there with: python3 -m pip install --target %s sglang-router",
				sglangRouter, sglangDir, sglangDir)
		}
		e.cmd.Env = []string{"PYTHONPATH=" + abs}
	}
	return e, true, nil
}
