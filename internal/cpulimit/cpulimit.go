// Package cpulimit caps a process's CPU time with a Linux cgroup CFS quota:
// the fleet benchmarks give each worker its own compute this way, and the
// worker's thread default is tested on a process limited like a pod.
package cpulimit

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// A Group caps one process's CPU time with a Linux cgroup CFS quota, so
// that each worker behaves like a pod with its own compute: on a shared
// machine three unlimited workers simply split the cores, and a policy that
// leaves one pod idle loses nothing — unlike on real GPUs, where an idle pod
// is idle capacity. cgroup v2 (cpu.max) and v1 (cpu.cfs_quota_us) are
// supported; both need write access to the cgroup filesystem.
type Group struct{ dir string }

const cfsPeriodUS = 100000

// Apply moves pid into a new cgroup allowed cpus CPUs' worth of time.
func Apply(pid int, cpus float64) (*Group, error) {
	quota := int(cpus * cfsPeriodUS)
	if quota < 1000 {
		return nil, fmt.Errorf("cpu limit %g is below 0.01 CPU", cpus)
	}
	name := fmt.Sprintf("llmf-cpulimit-%d", pid)
	if ctl, err := os.ReadFile("/sys/fs/cgroup/cgroup.controllers"); err == nil && strings.Contains(string(ctl), "cpu") {
		return mkCgroup(filepath.Join("/sys/fs/cgroup", name), pid,
			map[string]string{"cpu.max": fmt.Sprintf("%d %d", quota, cfsPeriodUS)})
	}
	if _, err := os.Stat("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"); err == nil {
		return mkCgroup(filepath.Join("/sys/fs/cgroup/cpu", name), pid,
			map[string]string{"cpu.cfs_period_us": fmt.Sprint(cfsPeriodUS), "cpu.cfs_quota_us": fmt.Sprint(quota)})
	}
	return nil, errors.New("no writable cgroup cpu controller (v2 cpu.max or v1 cpu.cfs_quota_us) to limit worker CPU")
}

func mkCgroup(dir string, pid int, files map[string]string) (*Group, error) {
	if err := os.Mkdir(dir, 0o755); err != nil {
		return nil, fmt.Errorf("cgroup: %w", err)
	}
	l := &Group{dir: dir}
	// The period first: v1 checks the quota against it.
	for _, f := range []string{"cpu.cfs_period_us", "cpu.cfs_quota_us", "cpu.max"} {
		if v, ok := files[f]; ok {
			if err := os.WriteFile(filepath.Join(dir, f), []byte(v), 0o644); err != nil {
				l.Remove()
				return nil, fmt.Errorf("cgroup %s: %w", f, err)
			}
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(fmt.Sprint(pid)), 0o644); err != nil {
		l.Remove()
		return nil, fmt.Errorf("cgroup: move %d: %w", pid, err)
	}
	return l, nil
}

// Throttled reports how many CFS periods the group was held back in.
func (l *Group) Throttled() (int, error) {
	b, err := os.ReadFile(filepath.Join(l.dir, "cpu.stat"))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		var n int
		if _, err := fmt.Sscanf(line, "nr_throttled %d", &n); err == nil {
			return n, nil
		}
	}
	return 0, errors.New("cpu.stat has no nr_throttled")
}

// Remove deletes the cgroup; it must be empty (its process gone).
func (l *Group) Remove() { _ = os.Remove(l.dir) }

// Set changes the group's quota to cpus CPUs' worth of time (a pod slowed
// down and back, in the chaos run).
func (l *Group) Set(cpus float64) error {
	quota := int(cpus * cfsPeriodUS)
	if quota < 1000 {
		return fmt.Errorf("cpu limit %g is below 0.01 CPU", cpus)
	}
	if _, err := os.Stat(filepath.Join(l.dir, "cpu.max")); err == nil {
		return os.WriteFile(filepath.Join(l.dir, "cpu.max"), []byte(fmt.Sprintf("%d %d", quota, cfsPeriodUS)), 0o644)
	}
	return os.WriteFile(filepath.Join(l.dir, "cpu.cfs_quota_us"), []byte(fmt.Sprint(quota)), 0o644)
}
