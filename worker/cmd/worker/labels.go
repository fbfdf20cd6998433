package main

import (
	"bufio"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// LabelsEnv holds labels as "k=v,k2=v2" (a Deployment's env), merged under
// --label and over --labels-file.
const LabelsEnv = "LLMF_WORKER_LABELS"

// labelFlags collects --label k=v (repeatable).
type labelFlags map[string]string

func (l labelFlags) String() string { return fmt.Sprint(map[string]string(l)) }

func (l labelFlags) Set(v string) error {
	k, val, err := splitLabel(v)
	if err != nil {
		return err
	}
	if _, dup := l[k]; dup {
		return fmt.Errorf("label %q given twice", k)
	}
	l[k] = val
	return nil
}

func splitLabel(v string) (string, string, error) {
	k, val, ok := strings.Cut(v, "=")
	k = strings.TrimSpace(k)
	if !ok || k == "" {
		return "", "", fmt.Errorf("want key=value, got %q", v)
	}
	if len(k) > api.MaxLabelKeyLen || len(val) > api.MaxLabelValueLen {
		return "", "", fmt.Errorf("label %q: key at most %d bytes, value at most %d", k, api.MaxLabelKeyLen, api.MaxLabelValueLen)
	}
	return k, val, nil
}

// readLabelsFile reads the Kubernetes downward API's labels file: one
// `key="value"` per line, the value quoted as Go quotes strings.
func readLabelsFile(path string) (map[string]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("--labels-file: %w", err)
	}
	defer f.Close()
	out := map[string]string{}
	sc := bufio.NewScanner(f)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		if !ok || k == "" {
			return nil, fmt.Errorf("--labels-file %s:%d: want key=\"value\", got %q", path, n, line)
		}
		if strings.HasPrefix(v, `"`) {
			if v, err = strconv.Unquote(v); err != nil {
				return nil, fmt.Errorf("--labels-file %s:%d: bad quoted value in %q", path, n, line)
			}
		}
		if _, _, err := splitLabel(k + "=" + v); err != nil {
			return nil, fmt.Errorf("--labels-file %s:%d: %w", path, n, err)
		}
		out[k] = v
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("--labels-file: %w", err)
	}
	return out, nil
}

// labels merges the pod's labels: the downward API file, then the env,
// then --label, each overriding the one before.
func (o *options) labels(getenv func(string) string) (map[string]string, error) {
	out := map[string]string{}
	if o.labelsFile != "" {
		m, err := readLabelsFile(o.labelsFile)
		if err != nil {
			return nil, err
		}
		for k, v := range m {
			out[k] = v
		}
	}
	if env := strings.TrimSpace(getenv(LabelsEnv)); env != "" {
		for _, kv := range strings.Split(env, ",") {
			if strings.TrimSpace(kv) == "" {
				continue
			}
			k, v, err := splitLabel(kv)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", LabelsEnv, err)
			}
			out[k] = v
		}
	}
	for k, v := range o.labelFlags {
		out[k] = v
	}
	if len(out) > api.MaxPodLabels {
		return nil, fmt.Errorf("%d labels: the metadata center accepts at most %d", len(out), api.MaxPodLabels)
	}
	return out, nil
}
