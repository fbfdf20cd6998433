package deploy_test

import (
	"bufio"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// buildStage is the stage of a Dockerfile that runs `go build`: its ARG
// names and the shell command of that RUN, continuation lines joined.
type buildStage struct {
	args []string
	run  string
}

func readBuildStage(t *testing.T, path string) buildStage {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var instrs []string
	var cur strings.Builder
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if strings.HasPrefix(line, "#") || (line == "" && cur.Len() == 0) {
			continue // comments, also inside a continued instruction
		}
		if body, ok := strings.CutSuffix(line, `\`); ok {
			cur.WriteString(body + " ")
			continue
		}
		cur.WriteString(line)
		instrs = append(instrs, cur.String())
		cur.Reset()
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	var st buildStage
	for _, in := range instrs {
		word, rest, _ := strings.Cut(in, " ")
		switch strings.ToUpper(word) {
		case "FROM":
			st = buildStage{}
		case "ARG":
			name, _, _ := strings.Cut(rest, "=")
			st.args = append(st.args, name)
		case "RUN":
			if strings.Contains(rest, "go build") {
				st.run = rest
				return st
			}
		}
	}
	t.Fatalf("%s: no RUN with go build", path)
	return st
}

// The images that compile C (llama.cpp in the worker, the cgo .so in the
// gateway) take the instruction-set level as the build argument LLMF_MARCH,
// default to a portable baseline of the target platform, and the level
// reaches the compiler flags. The build's RUN command runs here for real
// under sh, from the repository root as in the image, with `go` replaced by
// a recorder of the environment it gets and `uname` reporting the target's
// machine (what the kernel reports to a native or emulated build).
func TestImagesTakeTheInstructionSetLevel(t *testing.T) {
	cc, ccErr := exec.LookPath("cc")
	for _, name := range []string{"worker", "gateway"} {
		t.Run(name, func(t *testing.T) {
			st := readBuildStage(t, filepath.Join("images", name+".Dockerfile"))
			for _, a := range []string{"LLMF_MARCH", "TARGETARCH"} {
				if !slices.Contains(st.args, a) {
					t.Errorf("the build stage declares no ARG %s (args %v)", a, st.args)
				}
			}
			for _, tc := range []struct {
				arch, march       string
				want, wantGOAMD64 string
			}{
				{"amd64", "", "x86-64-v2", "v2"},
				{"amd64", "x86-64-v3", "x86-64-v3", "v3"},
				{"amd64", "znver3", "znver3", ""},
				{"arm64", "", "armv8-a", ""},
				{"arm64", "armv8.2-a", "armv8.2-a", ""},
			} {
				env := runBuildCommand(t, st.run, tc.arch, tc.march)
				for _, k := range []string{"CGO_CFLAGS", "CGO_CXXFLAGS"} {
					flags := strings.Fields(env[k])
					if !slices.Contains(flags, "-march="+tc.want) || !slices.Contains(flags, "-O3") {
						t.Errorf("%s LLMF_MARCH=%q: %s=%q, want -O3 -march=%s", tc.arch, tc.march, k, env[k], tc.want)
					}
					if amx := slices.Contains(flags, "-mno-amx-tile"); amx != (tc.arch == "amd64") {
						t.Errorf("%s: %s=%q: the -mno-amx-* options are for x86 only", tc.arch, k, env[k])
					}
				}
				if env["GOAMD64"] != tc.wantGOAMD64 {
					t.Errorf("%s LLMF_MARCH=%q: GOAMD64=%q, want %q", tc.arch, tc.march, env["GOAMD64"], tc.wantGOAMD64)
				}
				if env["CGO_ENABLED"] != "1" {
					t.Errorf("CGO_ENABLED=%q in the build", env["CGO_ENABLED"])
				}
				// The host compiler accepts the x86 flags the image uses.
				if tc.arch == "amd64" && ccErr == nil {
					out, err := exec.Command(cc, append(strings.Fields(env["CGO_CFLAGS"]), "-x", "c", "-c", "-o", os.DevNull, os.DevNull)...).CombinedOutput()
					if err != nil {
						t.Errorf("cc %s: %v\n%s", env["CGO_CFLAGS"], err, out)
					}
				}
			}
		})
	}
}

// runBuildCommand runs a Dockerfile RUN command as docker build would for
// platform linux/arch with --build-arg LLMF_MARCH=march, and returns the
// environment `go` was started with.
func runBuildCommand(t *testing.T, run, arch, march string) map[string]string {
	t.Helper()
	stub := t.TempDir()
	out := filepath.Join(stub, "go.env")
	machine := map[string]string{"amd64": "x86_64", "arm64": "aarch64"}[arch]
	scripts := map[string]string{
		"go":    "#!/bin/sh\nenv > \"$LLMF_TEST_GO_ENV\"\n",
		"uname": "#!/bin/sh\necho " + machine + "\n",
	}
	for n, body := range scripts {
		if err := os.WriteFile(filepath.Join(stub, n), []byte(body), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command("/bin/sh", "-c", run)
	cmd.Dir = ".." // WORKDIR /src holds the repository
	// What the stage sees: its ARGs and ENV, nothing of this process's
	// CGO_* flags.
	cmd.Env = []string{
		"PATH=" + stub + ":/usr/bin:/bin",
		"TARGETARCH=" + arch,
		"LLMF_MARCH=" + march,
		"CGO_ENABLED=1",
		"LLMF_TEST_GO_ENV=" + out,
	}
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("RUN %s (%s): %v\n%s", run, arch, err, b)
	}
	b, err := os.ReadFile(out)
	if err != nil {
		t.Fatalf("go was not run: %v", err)
	}
	env := map[string]string{}
	for _, l := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(l, "="); ok {
			env[k] = v
		}
	}
	return env
}
