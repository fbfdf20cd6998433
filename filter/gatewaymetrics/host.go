package gatewaymetrics

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
)

// NewHostRegistry is a gateway process's registry (the standalone gateway,
// the endpoint picker): the Go and process collectors and every gateway
// metric, declared for cfg's rules.
func NewHostRegistry(cfg *config.Config) (*prometheus.Registry, *Prom, error) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	pm, err := NewProm(reg)
	if err != nil {
		return nil, nil, err
	}
	pm.Declare(cfg)
	return reg, pm, nil
}
