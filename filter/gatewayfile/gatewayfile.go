// Package gatewayfile reads the fleet's YAML file that the standalone
// gateway (filter/cmd/gateway) and the endpoint picker (filter/cmd/epp)
// both take with --config: `listen:` (the gateway's HTTP address, the
// picker's gRPC address), optional `log_level`, `default_cluster` and
// `connect_retries`, and the filter's document under `filter:`
// (docs/configuration.md). One file describes a fleet for either host.
package gatewayfile

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"

	"sigs.k8s.io/yaml"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
)

// DefaultListen is `listen` when the file leaves it out.
const DefaultListen = "127.0.0.1:8000"

// File is the host's part of the file; the filter's document is parsed
// into a *config.Config beside it.
type File struct {
	Listen   string `json:"listen"`
	LogLevel string `json:"log_level"`
	// DefaultCluster names a cluster of filter.endpoints.static whose pods
	// take, round robin, the requests the filter does not route (no body:
	// GET /v1/models, health checks), as the route's cluster would in Envoy.
	DefaultCluster string `json:"default_cluster"`
	// ConnectRetries is how often a request whose connection to its pod
	// failed (nothing was sent: the pod died, or is restarting) is sent to
	// another pod of its cluster (standalone.Options.ConnectRetries, Envoy's
	// retry_on: connect-failure with previous_hosts). Default 1; 0: none.
	// The endpoint picker offers as many fallback pods per request.
	ConnectRetries *int            `json:"connect_retries"`
	Filter         json.RawMessage `json:"filter"`
}

// Load reads and checks the file at path.
func Load(path string) (*File, *config.Config, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, err
	}
	return Parse(path, raw)
}

// Parse is Load on the file's bytes; name prefixes the errors.
func Parse(name string, raw []byte) (*File, *config.Config, error) {
	j, err := yaml.YAMLToJSON(raw)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: not valid YAML: %w", name, err)
	}
	var fc File
	dec := json.NewDecoder(bytes.NewReader(j))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&fc); err != nil {
		return nil, nil, fmt.Errorf("%s: %w", name, err)
	}
	if fc.Listen == "" {
		fc.Listen = DefaultListen
	}
	if len(fc.Filter) == 0 || string(fc.Filter) == "null" {
		return nil, nil, fmt.Errorf("%s: filter: missing", name)
	}
	cfg, err := config.Parse(fc.Filter)
	if err != nil {
		return nil, nil, fmt.Errorf("%s: filter.%w", name, err)
	}
	if fc.ConnectRetries == nil {
		one := 1
		fc.ConnectRetries = &one
	}
	if *fc.ConnectRetries < 0 || *fc.ConnectRetries > 8 {
		return nil, nil, fmt.Errorf("%s: connect_retries: %d is not within 0..8", name, *fc.ConnectRetries)
	}
	if fc.DefaultCluster != "" {
		if _, ok := cfg.Endpoints.Static[fc.DefaultCluster]; !ok {
			return nil, nil, fmt.Errorf("%s: default_cluster: %q is not listed under filter.endpoints.static", name, fc.DefaultCluster)
		}
	}
	if _, err := fc.Level(); err != nil {
		return nil, nil, fmt.Errorf("%s: log_level: %w", name, err)
	}
	return &fc, cfg, nil
}

// Level is log_level as a slog level (info when unset).
func (f *File) Level() (slog.Level, error) {
	var l slog.Level
	if f.LogLevel == "" {
		return slog.LevelInfo, nil
	}
	err := l.UnmarshalText([]byte(f.LogLevel))
	return l, err
}
