package fleet

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// startRedis starts what Spec.Store asks for when it needs a Redis the
// spec does not name: one redis-server for "redis", or a Redis Cluster of
// three masters and three replicas for "redis-cluster". It returns the
// metadata center's --redis-addr value. Debian's redis-server and
// redis-cli must be on PATH.
func (f *Fleet) startRedis(ctx context.Context, s Spec) (string, error) {
	n := 1
	if s.Store == "redis-cluster" {
		n = 6
	}
	var addrs []string
	for i := range n {
		addr, err := freeAddr()
		if err != nil {
			return "", err
		}
		bus, err := freeAddr()
		if err != nil {
			return "", err
		}
		dir := filepath.Join(s.LogDir, fmt.Sprintf("redis-%d", i))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return "", err
		}
		port, busPort := portOf(addr), portOf(bus)
		args := []string{"--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
			"--dir", dir, "--protected-mode", "no"}
		if n > 1 {
			args = append(args, "--cluster-enabled", "yes", "--cluster-port", busPort,
				"--cluster-config-file", filepath.Join(dir, "nodes.conf"), "--cluster-node-timeout", "2000",
				"--repl-diskless-sync-delay", "0")
		}
		p, err := f.spawnPath(s, "redis-server", fmt.Sprintf("redis-%d", i), args...)
		if err != nil {
			return "", err
		}
		if n == 1 {
			f.redis, f.redisArgs, f.RedisAddr = p, args, addr
		}
		addrs = append(addrs, addr)
	}
	for _, a := range addrs {
		if err := waitRedis(ctx, a, "PONG", "ping"); err != nil {
			return "", err
		}
	}
	if n == 1 {
		return addrs[0], nil
	}
	args := append([]string{"--cluster", "create"}, addrs...)
	args = append(args, "--cluster-replicas", "1", "--cluster-yes")
	if out, err := exec.CommandContext(ctx, "redis-cli", args...).CombinedOutput(); err != nil {
		return "", fmt.Errorf("redis-cli --cluster create: %v\n%s", err, out)
	}
	for _, a := range addrs {
		if err := waitRedis(ctx, a, "cluster_state:ok", "cluster", "info"); err != nil {
			return "", err
		}
	}
	return strings.Join(addrs, ","), nil
}

func portOf(addr string) string {
	_, p, _ := strings.Cut(addr, ":")
	if _, err := strconv.Atoi(p); err != nil {
		return ""
	}
	return p
}

// waitRedis runs redis-cli against addr until its answer contains want.
func waitRedis(ctx context.Context, addr, want string, cmd ...string) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, _ := exec.CommandContext(ctx, "redis-cli", append([]string{"-p", portOf(addr)}, cmd...)...).Output()
		if strings.Contains(string(out), want) {
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("redis %s: %q never answered %q (last %q)", addr, cmd, want, out)
		}
		time.Sleep(100 * time.Millisecond)
	}
}
