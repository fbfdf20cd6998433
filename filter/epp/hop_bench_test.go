package epp_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/filter/epp/envoyrun"
	"github.com/istio-llm-filter/istio-llm-filter/filter/routing/routingtest"
	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/wait"
)

// BenchmarkExtProcHop measures what the picker adds to a request: the
// same chat request through the real Envoy straight to a pod
// (envoy-direct), and through Envoy with our endpoint picker (the
// filter/cmd/epp binary, its own process) deciding each request with the
// metadata center (envoy-epp; envoy-epp-duplex with both bodies
// FULL_DUPLEX_STREAMED). The pods answer at once, so the difference is the
// ext_proc hop with its decision. Reported at concurrency 8 (the aim: the
// hop adds at most 1 ms p50 and 3 ms p99) and 1 (the hop alone, no
// queueing): p50 and p99 latency in ms, and the processor time per
// request in µs of the picker's process (epp-cpu-µs), of Envoy
// (envoy-cpu-µs) and of the benchmark's own process, which holds the
// client, the pods and the metadata center (rest-cpu-µs).
//
//	LLMF_TEST_ENVOY=... go test -run '^$' -bench ExtProcHop -benchtime 4000x ./filter/epp/
func BenchmarkExtProcHop(b *testing.B) {
	bin := envoyBinary(b)
	pods := startPods(b, 4)
	mc := routingtest.Center(b)
	epp := startEPPProcess(b, fleetFile(mc.URL, addrs(pods)))
	for _, topo := range []struct {
		name string
		o    envoyrun.Options
	}{
		{"envoy-direct", envoyrun.Options{Binary: bin, Direct: addrs(pods)}},
		{"envoy-epp", envoyrun.Options{Binary: bin, EPP: epp.addr}},
		{"envoy-epp-duplex", envoyrun.Options{Binary: bin, EPP: epp.addr, Duplex: true}},
	} {
		b.Run(topo.name, func(b *testing.B) {
			e, err := envoyrun.Start(context.Background(), topo.o)
			if err != nil {
				b.Fatal(err)
			}
			defer e.Close()
			url := e.URL() + "/v1/chat/completions"
			body := chat(false, strings.Repeat("a system prompt shared by many requests. ", 40), "and a question")
			hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 16}}
			do := func() time.Duration {
				t0 := time.Now()
				resp, err := hc.Post(url, "application/json", strings.NewReader(body))
				if err != nil {
					b.Error(err)
					return 0
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if resp.StatusCode != 200 {
					b.Errorf("status %d", resp.StatusCode)
				}
				return time.Since(t0)
			}
			for range 200 { // warm connections and caches
				do()
			}
			cpu := map[string]func() time.Duration{"envoy": must(b, e.CPUTime), "rest": selfCPU}
			if topo.o.EPP != "" {
				cpu["epp"] = must(b, epp.cpuTime)
			}
			for _, conc := range []int{8, 1} {
				b.Run(fmt.Sprintf("c%d", conc), func(b *testing.B) { measure(b, conc, do, cpu) })
			}
		})
	}
}

// measure runs b.N calls of do, conc at a time, and reports their p50
// and p99 in ms and each cpu clock's time per call in µs.
func measure(b *testing.B, conc int, do func() time.Duration, cpu map[string]func() time.Duration) {
	lat := make([]time.Duration, b.N)
	var next sync.Mutex
	i := 0
	var wg sync.WaitGroup
	before := map[string]time.Duration{}
	for name, clock := range cpu {
		before[name] = clock()
	}
	b.ResetTimer()
	for range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				next.Lock()
				k := i
				i++
				next.Unlock()
				if k >= b.N {
					return
				}
				lat[k] = do()
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	for name, clock := range cpu {
		b.ReportMetric(float64(clock()-before[name])/1e3/float64(b.N), name+"-cpu-µs")
	}
	slices.Sort(lat)
	q := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))]) / 1e6 }
	b.ReportMetric(q(0.50), "p50-ms")
	b.ReportMetric(q(0.99), "p99-ms")
}

// selfCPU is this process's processor time, user and system.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// must turns a clock that may fail into one that fails the benchmark.
func must(b *testing.B, clock func() (time.Duration, error)) func() time.Duration {
	return func() time.Duration {
		d, err := clock()
		if err != nil {
			b.Fatal(err)
		}
		return d
	}
}

// eppProcess is the filter/cmd/epp binary serving a fleet file.
type eppProcess struct {
	addr string
	cmd  *exec.Cmd
}

func (p *eppProcess) cpuTime() (time.Duration, error) { return envoyrun.ProcessCPU(p.cmd.Process.Pid) }

// startEPPProcess builds filter/cmd/epp and runs it on doc, its listen
// address replaced by a free port, until the benchmark ends.
func startEPPProcess(b *testing.B, doc string) *eppProcess {
	b.Helper()
	dir := b.TempDir()
	bin := filepath.Join(dir, "epp")
	if out, err := exec.Command("go", "build", "-o", bin, "github.com/istio-llm-filter/istio-llm-filter/filter/cmd/epp").CombinedOutput(); err != nil {
		b.Fatalf("go build filter/cmd/epp: %v\n%s", err, out)
	}
	free := func() string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		defer ln.Close()
		return ln.Addr().String()
	}
	addr, metrics := free(), free()
	cfg := filepath.Join(dir, "fleet.yaml")
	if err := os.WriteFile(cfg, []byte(strings.Replace(doc, "listen: 127.0.0.1:0", "listen: "+addr, 1)), 0o644); err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command(bin, "--config", cfg, "--metrics-listen", metrics)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = cmd.Process.Signal(syscall.SIGTERM); _ = cmd.Wait() })
	wait.For(b, 30*time.Second, "the endpoint picker to serve", func() bool {
		resp, err := http.Get("http://" + metrics + "/healthz")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == http.StatusOK
	})
	return &eppProcess{addr: addr, cmd: cmd}
}
