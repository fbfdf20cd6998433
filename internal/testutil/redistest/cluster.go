package redistest

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// ClusterNodeTimeout is the cluster-node-timeout the test cluster runs with:
// short, so that a killed master is failed over in a couple of seconds
// instead of the default 15.
const ClusterNodeTimeout = 1000 * time.Millisecond

// Cluster is a real Redis Cluster on loopback: three masters and three
// replicas, each its own redis-server process, joined by
// `redis-cli --cluster create`.
type Cluster struct {
	Prefix string   // key prefix private to this test
	Addrs  []string // every node's host:port; the first three started as masters

	t     testing.TB
	dir   string
	nodes []*exec.Cmd
}

// StartCluster launches a 6-node cluster (3 masters + 3 replicas) and stops
// it when the test ends. It takes a few seconds, most of it the nodes
// agreeing on the configuration.
func StartCluster(t testing.TB) *Cluster {
	t.Helper()
	for _, bin := range []string{"redis-server", "redis-cli"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Fatalf("%s not on PATH (install Debian's redis-server, or run `make test`): %v", bin, err)
		}
	}
	c := &Cluster{t: t, dir: t.TempDir(), Prefix: uniquePrefix()}
	t.Cleanup(c.stopAll)
	ports := freePorts(t, 12) // a client port and a cluster-bus port per node
	for i := 0; i < 6; i++ {
		addr := fmt.Sprintf("127.0.0.1:%d", ports[2*i])
		c.Addrs = append(c.Addrs, addr)
		c.nodes = append(c.nodes, c.launch(i, ports[2*i], ports[2*i+1]))
	}
	args := append([]string{"--cluster", "create"}, c.Addrs...)
	args = append(args, "--cluster-replicas", "1", "--cluster-yes")
	out, err := exec.Command("redis-cli", args...).CombinedOutput()
	if err != nil {
		t.Fatalf("redis-cli --cluster create: %v\n%s", err, out)
	}
	c.WaitHealthy(20 * time.Second)
	return c
}

func (c *Cluster) launch(i, port, busPort int) *exec.Cmd {
	c.t.Helper()
	dir := filepath.Join(c.dir, strconv.Itoa(i))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		c.t.Fatal(err)
	}
	cmd := exec.Command("redis-server",
		"--port", strconv.Itoa(port), "--bind", "127.0.0.1",
		"--cluster-enabled", "yes", "--cluster-port", strconv.Itoa(busPort),
		"--cluster-config-file", filepath.Join(dir, "nodes.conf"),
		"--cluster-node-timeout", strconv.Itoa(int(ClusterNodeTimeout.Milliseconds())),
		// Replicas sync at once (the default waits 5s for more of them),
		// and one that lost its master for a while may still take over.
		"--repl-diskless-sync-delay", "0", "--cluster-replica-validity-factor", "0",
		"--save", "", "--appendonly", "no", "--dir", dir,
		"--protected-mode", "no")
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		c.t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		c.t.Fatalf("start redis-server: %v", err)
	}
	logf, err := os.Create(filepath.Join(dir, "log"))
	if err != nil {
		c.t.Fatal(err)
	}
	ready := make(chan struct{})
	go func() {
		defer logf.Close()
		sc := bufio.NewScanner(stdout)
		signalled := false
		for sc.Scan() {
			fmt.Fprintln(logf, sc.Text())
			if !signalled && strings.Contains(sc.Text(), "Ready to accept connections") {
				close(ready)
				signalled = true
			}
		}
	}()
	select {
	case <-ready:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		c.t.Fatal("redis-server (cluster node) did not become ready in 10s")
	}
	return cmd
}

// cli runs redis-cli against one node and returns its output.
func cli(addr string, args ...string) (string, error) {
	host, port, _ := net.SplitHostPort(addr)
	out, err := exec.Command("redis-cli", append([]string{"-h", host, "-p", port}, args...)...).Output()
	return string(out), err
}

// WaitHealthy waits until every running node reports cluster_state:ok, all
// 16384 slots are served and every replica is in sync with its master,
// failing the test after within.
func (c *Cluster) WaitHealthy(within time.Duration) {
	c.t.Helper()
	deadline := time.Now().Add(within)
	for {
		ok, why := c.healthy()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			c.t.Fatalf("redis cluster not healthy after %v: %s", within, why)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (c *Cluster) healthy() (bool, string) {
	for i, addr := range c.Addrs {
		if c.nodes[i] == nil {
			continue
		}
		info, err := cli(addr, "cluster", "info")
		if err != nil {
			return false, fmt.Sprintf("%s: %v", addr, err)
		}
		if !strings.Contains(info, "cluster_state:ok") || !strings.Contains(info, "cluster_slots_ok:16384") {
			return false, fmt.Sprintf("%s: %s", addr, strings.ReplaceAll(strings.TrimSpace(info), "\r\n", " "))
		}
		// A replica that has not finished its first sync cannot take over.
		repl, err := cli(addr, "info", "replication")
		if err != nil {
			return false, fmt.Sprintf("%s: %v", addr, err)
		}
		if strings.Contains(repl, "role:slave") && !strings.Contains(repl, "master_link_status:up") {
			return false, fmt.Sprintf("%s: replica not in sync", addr)
		}
	}
	return true, ""
}

// MasterOf returns the index in Addrs of the node currently serving key as
// master.
func (c *Cluster) MasterOf(key string) int {
	c.t.Helper()
	for i, addr := range c.Addrs {
		if c.nodes[i] == nil {
			continue
		}
		slot, err := cli(addr, "cluster", "keyslot", key)
		if err != nil {
			continue
		}
		nodes, err := cli(addr, "cluster", "nodes")
		if err != nil {
			continue
		}
		n, _ := strconv.Atoi(strings.TrimSpace(slot))
		if m := masterForSlot(nodes, n); m != "" {
			for j, a := range c.Addrs {
				if a == m {
					return j
				}
			}
		}
	}
	c.t.Fatalf("no master found for key %q", key)
	return -1
}

// masterForSlot reads CLUSTER NODES output: "id addr@bus flags master ... slots...".
func masterForSlot(nodes string, slot int) string {
	for _, line := range strings.Split(nodes, "\n") {
		f := strings.Fields(line)
		if len(f) < 9 || !strings.Contains(f[2], "master") || strings.Contains(f[2], "fail") {
			continue
		}
		for _, r := range f[8:] {
			lo, hi, found := strings.Cut(r, "-")
			a, err1 := strconv.Atoi(lo)
			b := a
			var err2 error
			if found {
				b, err2 = strconv.Atoi(hi)
			}
			if err1 == nil && err2 == nil && slot >= a && slot <= b {
				addr, _, _ := strings.Cut(f[1], "@")
				return addr
			}
		}
	}
	return ""
}

// Log returns what node i has logged so far (diagnostics for failures).
func (c *Cluster) Log(i int) string {
	b, _ := os.ReadFile(filepath.Join(c.dir, strconv.Itoa(i), "log"))
	return string(b)
}

// Kill stops node i with SIGKILL, as a crashed master would stop.
func (c *Cluster) Kill(i int) {
	if c.nodes[i] == nil || c.nodes[i].Process == nil {
		return
	}
	_ = c.nodes[i].Process.Kill()
	_ = c.nodes[i].Wait()
	c.nodes[i] = nil
}

func (c *Cluster) stopAll() {
	for i := range c.nodes {
		c.Kill(i)
	}
}

// freePorts returns n distinct free loopback ports (held open together, so
// none is handed out twice).
func freePorts(t testing.TB, n int) []int {
	t.Helper()
	ports := make([]int, 0, n)
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports
}
