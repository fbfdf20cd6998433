// Package cpus tells how many CPUs this process may really use: the CPUs
// its scheduler affinity allows, capped by its cgroup's CPU bandwidth quota
// (cgroup v2 cpu.max, v1 cpu.cfs_quota_us / cpu.cfs_period_us) anywhere on
// the way from its cgroup up to the hierarchy's root — the same inputs Go's
// runtime uses for its default GOMAXPROCS.
//
// runtime.NumCPU alone sees the node, not the pod: a container limited to
// 4 CPUs on a 64-core node would start 64 llama.cpp threads that the kernel
// then throttles. The worker's default --threads is Threads() (docs/worker.md).
package cpus

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path"
	"runtime"
	"strconv"
	"strings"
)

// Limit is what this process may use.
type Limit struct {
	Affinity int     // CPUs in the scheduler affinity mask (runtime.NumCPU)
	Quota    float64 // CPUs' worth of time the cgroup quota allows; 0 = no quota
	Source   string  // the file the quota came from ("" without one)
}

// Threads is the compute thread count for this limit: the affinity, capped
// by the quota rounded down (at least 1). Down, not up as Go rounds
// GOMAXPROCS: ggml's threads meet at a barrier after every operation, so
// one thread throttled for the rest of a CFS period stalls all of them,
// while goroutines just wait their turn.
func (l Limit) Threads() int {
	n := max(1, l.Affinity)
	if l.Quota > 0 {
		n = min(n, max(1, int(math.Floor(l.Quota+1e-9))))
	}
	return n
}

// Detect reads this process's limit from the live system. A missing or
// unreadable cgroup filesystem is no quota, not an error: the process then
// runs wherever its affinity lets it.
func Detect() Limit {
	l, err := Read(os.DirFS("/"), "self")
	if err != nil {
		return Limit{Affinity: runtime.NumCPU()}
	}
	l.Affinity = runtime.NumCPU()
	return l
}

// Threads is Detect().Threads().
func Threads() int { return Detect().Threads() }

// Read finds the quota of process pid ("self" or a number) in root, a view
// of / (tests pass a directory of fixtures). Affinity is left 0.
func Read(root fs.FS, pid string) (Limit, error) {
	cg, err := fs.ReadFile(root, path.Join("proc", pid, "cgroup"))
	if err != nil {
		return Limit{}, err
	}
	mi, err := fs.ReadFile(root, path.Join("proc", pid, "mountinfo"))
	if err != nil {
		return Limit{}, err
	}
	mounts := parseMountinfo(string(mi))
	var best Limit
	for _, line := range strings.Split(strings.TrimSpace(string(cg)), "\n") {
		// hierarchy-id:controller-list:cgroup-path
		f := strings.SplitN(line, ":", 3)
		if len(f) != 3 {
			continue
		}
		v2 := f[0] == "0" && f[1] == ""
		if !v2 && !hasWord(f[1], "cpu") {
			continue
		}
		for _, m := range mounts {
			if (v2 && m.fstype == "cgroup2") || (!v2 && m.fstype == "cgroup" && hasWord(m.opts, "cpu")) {
				q, src, err := walk(root, m, f[2], v2)
				if err != nil {
					return Limit{}, err
				}
				if q > 0 && (best.Quota == 0 || q < best.Quota) {
					best.Quota, best.Source = q, src
				}
			}
		}
	}
	return best, nil
}

type mount struct{ root, point, fstype, opts string }

// parseMountinfo keeps the fields of /proc/PID/mountinfo this package needs:
// the root of the mount within its filesystem, where it is mounted, the
// filesystem type and its super options (v1 lists its controllers there).
func parseMountinfo(s string) []mount {
	var out []mount
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		sep := -1
		for i, x := range f {
			if x == "-" {
				sep = i
				break
			}
		}
		if sep < 6 || len(f) < sep+2 {
			continue
		}
		opts := ""
		if len(f) > sep+3 {
			opts = f[sep+3]
		}
		out = append(out, mount{root: unescape(f[3]), point: unescape(f[4]), fstype: f[sep+1], opts: opts})
	}
	return out
}

// unescape undoes mountinfo's octal escapes (\040 for a space).
func unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func hasWord(list, w string) bool {
	for _, x := range strings.Split(list, ",") {
		if x == w {
			return true
		}
	}
	return false
}

// walk reads the quota of cgroup cgPath and of every ancestor visible under
// mount m, returning the smallest (a parent's limit binds its children).
// A cgroup path outside the mount's root (another namespace's view) has no
// readable files: no quota.
func walk(root fs.FS, m mount, cgPath string, v2 bool) (float64, string, error) {
	rel, ok := strings.CutPrefix(cgPath, m.root)
	if !ok || (rel != "" && m.root != "/" && !strings.HasPrefix(rel, "/")) {
		return 0, "", nil
	}
	best, src := 0.0, ""
	for dir := path.Join(m.point, rel); ; dir = path.Dir(dir) {
		q, file, err := readQuota(root, strings.TrimPrefix(dir, "/"), v2)
		if err != nil {
			return 0, "", err
		}
		if q > 0 && (best == 0 || q < best) {
			best, src = q, file
		}
		if dir == m.point || dir == "/" || dir == "." {
			return best, src, nil
		}
	}
}

// readQuota reads one cgroup directory's quota in CPUs (0 = none, or no
// such files).
func readQuota(root fs.FS, dir string, v2 bool) (float64, string, error) {
	if v2 {
		file := path.Join(dir, "cpu.max")
		b, err := fs.ReadFile(root, file)
		if errors.Is(err, fs.ErrNotExist) {
			return 0, "", nil
		}
		if err != nil {
			return 0, "", err
		}
		f := strings.Fields(string(b))
		if len(f) != 2 {
			return 0, "", fmt.Errorf("cpus: %s: want \"quota period\", got %q", file, b)
		}
		if f[0] == "max" {
			return 0, "", nil
		}
		q, err1 := strconv.ParseFloat(f[0], 64)
		p, err2 := strconv.ParseFloat(f[1], 64)
		if err1 != nil || err2 != nil || q <= 0 || p <= 0 {
			return 0, "", fmt.Errorf("cpus: %s: bad quota %q", file, b)
		}
		return q / p, "/" + file, nil
	}
	qf, pf := path.Join(dir, "cpu.cfs_quota_us"), path.Join(dir, "cpu.cfs_period_us")
	qb, err := fs.ReadFile(root, qf)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, "", nil
	}
	if err != nil {
		return 0, "", err
	}
	pb, err := fs.ReadFile(root, pf)
	if err != nil {
		return 0, "", err
	}
	q, err1 := strconv.ParseFloat(strings.TrimSpace(string(qb)), 64)
	p, err2 := strconv.ParseFloat(strings.TrimSpace(string(pb)), 64)
	if err1 != nil || err2 != nil || p <= 0 {
		return 0, "", fmt.Errorf("cpus: %s / %s: bad quota %q / %q", qf, pf, qb, pb)
	}
	if q <= 0 { // -1: unlimited
		return 0, "", nil
	}
	return q / p, "/" + qf, nil
}
