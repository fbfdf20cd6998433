package fleet

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/istio-llm-filter/istio-llm-filter/filter/epp/envoyrun"
)

// Topologies of Spec.Topology: how clients reach the workers.
const (
	// TopologyGateway is the standalone gateway (the default, "").
	TopologyGateway = "gateway"
	// TopologyEnvoyEPP is the upstream Envoy with our endpoint picker
	// (bin/epp) as its ext_proc service, as Istio serves an InferencePool.
	TopologyEnvoyEPP = "envoy-epp"
	// TopologyEnvoyDirect is the same Envoy straight to the workers (its
	// own least-request balancing), the baseline of the picker's hop.
	TopologyEnvoyDirect = "envoy-direct"
)

// StartEnvoyEPP starts the endpoint picker on the standalone gateway's
// own file (filter/gatewayfile) and the upstream Envoy in front of it,
// sharing the fleet's workers and metadata center; it returns Envoy's
// base URL. envoyBin "" = $LLMF_TEST_ENVOY. Both stop with the fleet.
func (f *Fleet) StartEnvoyEPP(ctx context.Context, envoyBin string) (string, error) {
	grpcAddr, err := freeAddr()
	if err != nil {
		return "", err
	}
	metrics, err := freeAddr()
	if err != nil {
		return "", err
	}
	name := fmt.Sprintf("epp-%d", len(f.closers))
	cfg := filepath.Join(f.LogDir, name+".yaml")
	if err := os.WriteFile(cfg, []byte(gatewayConfig(grpcAddr, f.MC, f.spec, f.Workers)), 0o644); err != nil {
		return "", err
	}
	if _, err := f.spawn(f.spec, "epp", name, "--config", cfg, "--metrics-listen", metrics); err != nil {
		return "", err
	}
	if err := waitHealthy(ctx, "http://"+metrics+"/healthz"); err != nil {
		return "", fmt.Errorf("%s: %w", name, err)
	}
	return f.startEnvoy(ctx, name+"-envoy", envoyrun.Options{Binary: envoyBin, EPP: grpcAddr, Retries: 2})
}

// StartEnvoyDirect starts the upstream Envoy straight to the workers.
func (f *Fleet) StartEnvoyDirect(ctx context.Context, envoyBin string) (string, error) {
	return f.startEnvoy(ctx, fmt.Sprintf("envoy-direct-%d", len(f.closers)), envoyrun.Options{Binary: envoyBin, Direct: f.Workers, Retries: 2})
}

func (f *Fleet) startEnvoy(ctx context.Context, name string, o envoyrun.Options) (string, error) {
	logf, err := os.OpenFile(filepath.Join(f.LogDir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return "", err
	}
	o.Stderr = logf
	e, err := envoyrun.Start(ctx, o)
	if err != nil {
		logf.Close()
		return "", fmt.Errorf("%s: %w", name, err)
	}
	f.closers = append(f.closers, func() { _ = e.Close(); logf.Close() })
	return e.URL(), nil
}
