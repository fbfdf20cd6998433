package main

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

// --pods N listens on N free ports, lists them in --addr-file, and every
// pod answers /health until the command is stopped.
func TestPodsListTheirAddressesAndServe(t *testing.T) {
	file := filepath.Join(t.TempDir(), "pods")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	go func() {
		done <- run(ctx, []string{"--pods", "3", "--listen", "127.0.0.1:0", "--addr-file", file}, log)
	}()
	var addrs []string
	wait.For(t, 10*time.Second, "the address file", func() bool {
		b, err := os.ReadFile(file)
		addrs = strings.Fields(string(b))
		return err == nil
	})
	if len(addrs) != 3 || addrs[0] == addrs[1] || addrs[1] == addrs[2] {
		t.Fatalf("addresses %v, want 3 distinct", addrs)
	}
	for _, a := range addrs {
		resp, err := http.Get("http://" + a + "/health")
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("%s /health: %v %v", a, resp, err)
		}
		resp.Body.Close()
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("stopped with %v", err)
	}
}

// A configuration vLLM would refuse to start with is refused.
func TestRefusesAnImpossibleConfiguration(t *testing.T) {
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	err := run(context.Background(), []string{"--num-gpu-blocks", "10", "--max-model-len", "1000"}, log)
	if err == nil || !strings.Contains(err.Error(), "exceeds the KV cache") {
		t.Fatalf("max model len over the KV cache: %v", err)
	}
	if err := run(context.Background(), []string{"--max-num-seqs", "0"}, log); err == nil {
		t.Fatal("--max-num-seqs 0 accepted")
	}
}
