// Command epp is the endpoint picker (filter/epp): the gateway's decision
// behind any Gateway API Inference Extension gateway (Istio's, Envoy
// Gateway's, kgateway's InferencePool support), served as Envoy's
// ext_proc gRPC service, with the gRPC health service beside it.
//
//	go run ./filter/cmd/epp --config fleet.yaml
//
// The file is the standalone gateway's own (filter/gatewayfile): `listen`
// is the gRPC address, filter.endpoints.static the pods, and
// filter.metadata_center the shared view that lets several replicas run
// active-active. In Kubernetes, --pool-name NAME takes the endpoints from the
// InferencePool NAME (filter/epp/poolsource) instead: the ready pods its
// selector matches, the pool's name being the cluster the rules name.
// --metrics-listen serves /metrics (Prometheus) and /healthz. The picker
// runs on one processor unless --procs or $GOMAXPROCS say otherwise.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"runtime"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/istio-llm-filter/istio-llm-filter/filter/epp"
	"github.com/istio-llm-filter/istio-llm-filter/filter/epp/poolsource"
	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewayfile"
	"github.com/istio-llm-filter/istio-llm-filter/filter/gatewaymetrics"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, os.Args[1:], os.Stderr, nil); err != nil {
		fmt.Fprintln(os.Stderr, "epp:", err)
		os.Exit(1)
	}
}

// DefaultProcs is the picker's default GOMAXPROCS. The picker waits on the
// network: every message of an exchange wakes it for a few microseconds of
// work, and each more processor only adds idle threads woken and spinning
// for that work (on the hop benchmark's two cores one processor takes a
// fifth less CPU per request at concurrency 8 and a third less at 1;
// docs/benchmarks.md, "The endpoint picker's hop").
const DefaultProcs = 1

// run serves until ctx ends. ready, if not nil, receives the gRPC address.
func run(ctx context.Context, args []string, logOut io.Writer, ready chan<- net.Addr) error {
	fs := flag.NewFlagSet("epp", flag.ContinueOnError)
	fs.SetOutput(logOut)
	path := fs.String("config", "", "fleet YAML file (listen: the gRPC address, filter:)")
	metricsAddr := fs.String("metrics-listen", "", "address of /metrics and /healthz (HTTP); empty: none")
	poolName := fs.String("pool-name", "", "the InferencePool whose ready pods are the endpoints (in-cluster); its name is the cluster the rules name")
	poolNS := fs.String("pool-namespace", os.Getenv("POD_NAMESPACE"), "the InferencePool's namespace (default $POD_NAMESPACE)")
	hooks := fs.Bool("conformance-test-hooks", false, "honour the "+epp.TestSelectionHeader+" request header and echo "+epp.TestServedHeader+" (Inference Extension conformance tests)")
	procs := fs.Int("procs", DefaultProcs, "processors running the picker's Go code (GOMAXPROCS; without this flag $GOMAXPROCS, if set, applies); 0: Go's own choice, the CPUs available. Replicas, which run active-active, add throughput")
	if err := fs.Parse(args); err != nil {
		return err
	}
	explicit := false
	fs.Visit(func(f *flag.Flag) { explicit = explicit || f.Name == "procs" })
	if *procs > 0 && (explicit || os.Getenv("GOMAXPROCS") == "") {
		defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(*procs))
	}
	if *path == "" {
		return errors.New("--config FILE is required")
	}
	fc, cfg, err := gatewayfile.Load(*path)
	if err != nil {
		return err
	}
	level, _ := fc.Level() // checked by Load
	logger := slog.New(slog.NewTextHandler(logOut, &slog.HandlerOptions{Level: level}))

	reg, pm, err := gatewaymetrics.NewHostRegistry(cfg)
	if err != nil {
		return err
	}
	bo := epp.BuildOptions{Logger: logger, Metrics: pm, Registerer: reg, ConformanceHooks: *hooks}
	if *poolName != "" {
		src, err := watchPool(ctx, *poolNS, *poolName, logger)
		if err != nil {
			return err
		}
		bo.Endpoints, bo.PoolName = src, *poolName
	}
	srv, closeReports, err := epp.Build(fc, cfg, bo)
	if err != nil {
		return err
	}
	defer closeReports()

	ln, err := net.Listen("tcp", fc.Listen)
	if err != nil {
		return err
	}
	g := epp.NewGRPCServer()
	srv.Register(g)
	errc := make(chan error, 2)
	var hs *http.Server
	if *metricsAddr != "" {
		mux := http.NewServeMux()
		mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = io.WriteString(w, "ok\n") })
		mln, err := net.Listen("tcp", *metricsAddr)
		if err != nil {
			return err
		}
		hs = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		go func() { errc <- hs.Serve(mln) }()
	}
	logger.Info("endpoint picker listening", "addr", ln.Addr().String(), "metadata_center", cfg.MetadataCenter.Address)
	if ready != nil {
		ready <- ln.Addr()
	}
	go func() { errc <- g.Serve(ln) }()
	select {
	case err := <-errc:
		g.Stop()
		return err
	case <-ctx.Done():
	}
	srv.Shutdown()
	stopped := make(chan struct{})
	go func() { g.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		g.Stop()
	}
	if hs != nil {
		_ = hs.Close()
	}
	return nil
}

// watchPool watches the InferencePool namespace/name with the pod's
// service account (in-cluster configuration).
func watchPool(ctx context.Context, namespace, name string, logger *slog.Logger) (*poolsource.Source, error) {
	if namespace == "" {
		return nil, errors.New("--pool-namespace (or $POD_NAMESPACE) is required with --pool-name")
	}
	rc, err := rest.InClusterConfig()
	if err != nil {
		return nil, fmt.Errorf("--pool-name needs to run in a cluster: %w", err)
	}
	kc, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	dc, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, err
	}
	return poolsource.Start(ctx, kc, dc, namespace, name, logger)
}
