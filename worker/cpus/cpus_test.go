package cpus

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"testing/fstest"

	"github.com/istio-llm-filter/istio-llm-filter/internal/cpulimit"
)

const v2Mounts = `24 30 0:22 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate
30 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
`

const v1Mounts = `31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
`

func file(s string) *fstest.MapFile { return &fstest.MapFile{Data: []byte(s)} }

func TestReadParsesCgroupFiles(t *testing.T) {
	for _, c := range []struct {
		name    string
		fs      fstest.MapFS
		quota   float64
		source  string
		threads int // with 64 CPUs of affinity
	}{
		{
			name: "v2 pod limit binds the container below it",
			fs: fstest.MapFS{
				"proc/self/cgroup":                                   file("0::/kubepods/pod1/ctr\n"),
				"proc/self/mountinfo":                                file(v2Mounts),
				"sys/fs/cgroup/kubepods/pod1/cpu.max":                file("400000 100000\n"),
				"sys/fs/cgroup/kubepods/pod1/ctr/cpu.max":            file("max 100000\n"),
				"sys/fs/cgroup/kubepods/cpu.max":                     file("max 100000\n"),
				"sys/fs/cgroup/kubepods/pod1/ctr/cgroup.controllers": file("cpu\n"),
			},
			quota: 4, source: "/sys/fs/cgroup/kubepods/pod1/cpu.max", threads: 4,
		},
		{
			name: "v2 in a cgroup namespace, fractional quota rounds down",
			fs: fstest.MapFS{
				"proc/self/cgroup":      file("0::/\n"),
				"proc/self/mountinfo":   file(v2Mounts),
				"sys/fs/cgroup/cpu.max": file("150000 100000\n"),
			},
			quota: 1.5, source: "/sys/fs/cgroup/cpu.max", threads: 1,
		},
		{
			name: "v2 without a limit",
			fs: fstest.MapFS{
				"proc/self/cgroup":      file("0::/\n"),
				"proc/self/mountinfo":   file(v2Mounts),
				"sys/fs/cgroup/cpu.max": file("max 100000\n"),
			},
			threads: 64,
		},
		{
			name: "v1 cpu,cpuacct",
			fs: fstest.MapFS{
				"proc/self/cgroup":    file("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n1:name=systemd:/docker/abc\n"),
				"proc/self/mountinfo": file(v1Mounts),
				"sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us":  file("250000\n"),
				"sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": file("100000\n"),
				"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us":             file("-1\n"),
				"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us":            file("100000\n"),
			},
			quota: 2.5, source: "/sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", threads: 2,
		},
		{
			name: "v1 tiny quota still gets one thread",
			fs: fstest.MapFS{
				"proc/self/cgroup":                                 file("4:cpu,cpuacct:/\n"),
				"proc/self/mountinfo":                              file(v1Mounts),
				"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us":       file("20000\n"),
				"sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us":      file("100000\n"),
				"sys/fs/cgroup/cpu,cpuacct/unrelated/cpu.max":      file("junk"),
				"sys/fs/cgroup/cpu,cpuacct/unrelated/cgroup.procs": file(""),
			},
			quota: 0.2, source: "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", threads: 1,
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			l, err := Read(c.fs, "self")
			if err != nil {
				t.Fatal(err)
			}
			if l.Quota != c.quota || l.Source != c.source {
				t.Fatalf("quota %g from %q, want %g from %q", l.Quota, l.Source, c.quota, c.source)
			}
			l.Affinity = 64
			if got := l.Threads(); got != c.threads {
				t.Fatalf("threads %d, want %d", got, c.threads)
			}
		})
	}
}

func TestReadRefusesMalformedQuota(t *testing.T) {
	_, err := Read(fstest.MapFS{
		"proc/self/cgroup":      file("0::/\n"),
		"proc/self/mountinfo":   file(v2Mounts),
		"sys/fs/cgroup/cpu.max": file("lots\n"),
	}, "self")
	if err == nil || !strings.Contains(err.Error(), "cpu.max") {
		t.Fatalf("err = %v, want one naming cpu.max", err)
	}
}

func TestAffinityCapsThreads(t *testing.T) {
	if got := (Limit{Affinity: 3}).Threads(); got != 3 {
		t.Fatalf("no quota, 3 CPUs: %d threads", got)
	}
	if got := (Limit{Affinity: 2, Quota: 8}).Threads(); got != 2 {
		t.Fatalf("quota above affinity: %d threads, want 2", got)
	}
}

// The child half of the tests below: it waits until the parent has put it
// into a cgroup (or not), then prints what it detects.
func TestMain(m *testing.M) {
	if os.Getenv("LLMF_CPUS_CHILD") == "1" {
		bufio.NewReader(os.Stdin).ReadString('\n')
		json.NewEncoder(os.Stdout).Encode(Detect())
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// child runs this test binary as a child, applies setup to its pid and
// returns what it detected.
func child(t *testing.T, wrap []string, setup func(pid int) (func(), error)) Limit {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	args := append(wrap, exe)
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env = append(os.Environ(), "LLMF_CPUS_CHILD=1")
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	cmd.Stdout = &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var cleanup func()
	if setup != nil {
		if cleanup, err = setup(cmd.Process.Pid); err != nil {
			cmd.Process.Kill()
			cmd.Wait()
			t.Skipf("cannot limit CPU here: %v", err)
		}
	}
	fmt.Fprintln(in)
	err = cmd.Wait()
	if cleanup != nil {
		cleanup() // the cgroup must be empty to go
	}
	if err != nil {
		t.Fatalf("child: %v", err)
	}
	var l Limit
	if err := json.Unmarshal([]byte(out.String()), &l); err != nil {
		t.Fatalf("child said %q: %v", out.String(), err)
	}
	return l
}

func TestDetectSeesTheCgroupQuotaOfARealProcess(t *testing.T) {
	for _, c := range []struct {
		cpus    float64
		threads int
	}{{1, 1}, {1.5, 1}, {2, 2}} {
		l := child(t, nil, func(pid int) (func(), error) {
			g, err := cpulimit.Apply(pid, c.cpus)
			if err != nil {
				return nil, err
			}
			return g.Remove, nil
		})
		if l.Quota != c.cpus || l.Source == "" {
			t.Fatalf("under a %g CPU quota the child detected %+v", c.cpus, l)
		}
		if want := min(c.threads, runtime.NumCPU()); l.Threads() != want {
			t.Fatalf("under a %g CPU quota: %d threads, want %d", c.cpus, l.Threads(), want)
		}
	}
}

func TestDetectSeesTheAffinityOfARealProcess(t *testing.T) {
	if _, err := exec.LookPath("taskset"); err != nil {
		t.Skip("no taskset here")
	}
	l := child(t, []string{"taskset", "-c", "0"}, nil)
	if l.Affinity != 1 || l.Threads() != 1 {
		t.Fatalf("pinned to CPU 0 the child detected %+v (%d threads)", l, l.Threads())
	}
}
