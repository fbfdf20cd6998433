package main

import (
	"bytes"
	"context"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
)

// TestRunBothStores does a short, real load run against both stores and
// checks the report: the figures in the docs come from this same path.
func TestRunBothStores(t *testing.T) {
	srv := redistest.Shared(t)
	var out bytes.Buffer
	err := run(context.Background(), []string{
		"--stores", "memory,redis", "--redis-addr", srv.Addr, "--redis-key-prefix", srv.Prefix,
		"--requests", "400", "--duration", "20s", "--warmup", "0", "--concurrency", "8", "--progress", "0",
	}, &out, &out)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, out.String())
	}
	for _, store := range []string{"memory", "redis"} {
		re := regexp.MustCompile(store + `: 400 requests in [0-9.]+s: [0-9]+ req/s, p50 [0-9.]+ms, p90 [0-9.]+ms, p99 [0-9.]+ms, max [0-9.]+ms, errors 0`)
		if !re.MatchString(out.String()) {
			t.Fatalf("no %s report line in:\n%s", store, out.String())
		}
	}
	// Every query costs this process something, and on Redis the server
	// runs a script per query: neither figure can be zero.
	for _, re := range []*regexp.Regexp{
		regexp.MustCompile(`memory: CPU per query: this process ([0-9.]+) µs\n`),
		regexp.MustCompile(`redis: CPU per query: this process ([0-9.]+) µs, redis-server ([0-9.]+) µs\n`),
	} {
		m := re.FindStringSubmatch(out.String())
		if m == nil {
			t.Fatalf("no line %s in:\n%s", re, out.String())
		}
		for _, v := range m[1:] {
			if f, _ := strconv.ParseFloat(v, 64); f <= 0 {
				t.Fatalf("zero CPU per query in %q", m[0])
			}
		}
	}
}

func TestRefuses(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--addr", "http://10.1.2.3:8080"}, "not a loopback"},
		{[]string{"--addr", "http://example.com:8080"}, "not a loopback"},
		{[]string{"--requests", "0", "--duration", "0"}, "bounded"},
		{[]string{"--stores", "etcd", "--warmup", "0"}, "unknown store"},
	} {
		var out bytes.Buffer
		err := run(context.Background(), tc.args, &out, &out)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("run(%q) = %v, want error containing %q", tc.args, err, tc.want)
		}
	}
}
