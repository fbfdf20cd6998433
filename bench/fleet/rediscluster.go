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
		addr, err := f.startRedisNode(ctx, s, i, n > 1)
		if err != nil {
			return "", err
		}
		addrs = append(addrs, addr)
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

// startRedisNode starts redis-server number i on free ports and waits
// for it to answer. A port found free can be taken before redis-server
// binds it (an outgoing connection of another process is given the same
// ephemeral port; a cluster node needs two), and redis-server then exits:
// the node is started again on other ports, up to three times.
func (f *Fleet) startRedisNode(ctx context.Context, s Spec, i int, cluster bool) (string, error) {
	dir := filepath.Join(s.LogDir, fmt.Sprintf("redis-%d", i))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	var last error
	for range 3 {
		addr, err := freeAddr()
		if err != nil {
			return "", err
		}
		bus, err := freeAddr()
		if err != nil {
			return "", err
		}
		args := []string{"--port", portOf(addr), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
			"--dir", dir, "--protected-mode", "no"}
		if cluster {
			args = append(args, "--cluster-enabled", "yes", "--cluster-port", portOf(bus),
				"--cluster-config-file", filepath.Join(dir, "nodes.conf"), "--cluster-node-timeout", "2000",
				"--repl-diskless-sync-delay", "0")
		}
		p, err := f.spawnPath(s, "redis-server", fmt.Sprintf("redis-%d", i), args...)
		if err != nil {
			return "", err
		}
		if last = waitRedisFor(ctx, 10*time.Second, addr, "PONG", "ping"); last == nil {
			if !cluster {
				f.redis, f.redisArgs, f.RedisAddr = p, args, addr
			}
			return addr, nil
		}
		f.terminate(p)
		_ = os.Remove(filepath.Join(dir, "nodes.conf"))
	}
	return "", last
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
	return waitRedisFor(ctx, 30*time.Second, addr, want, cmd...)
}

// waitRedisFor is waitRedis giving up after d.
func waitRedisFor(ctx context.Context, d time.Duration, addr, want string, cmd ...string) error {
	deadline := time.Now().Add(d)
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
