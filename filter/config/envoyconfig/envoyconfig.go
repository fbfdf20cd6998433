// Package envoyconfig reads the filter's configuration as Envoy delivers it
// (plugin_config, a protobuf Any). It is apart from filter/config so that
// what reads the configuration from YAML (the standalone gateway, the
// benchmarks) does not link the xDS protobufs.
package envoyconfig

import (
	"errors"
	"fmt"

	xdstype "github.com/cncf/xds/go/xds/type/v3"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
)

// Parse reads the config as Envoy delivers plugin_config: an Any holding
// an xds.type.v3.TypedStruct whose value is the document, or (accepted for
// convenience) a google.protobuf.Struct holding it directly.
func Parse(a *anypb.Any) (*config.Config, error) {
	if a == nil {
		return nil, errors.New("config: no plugin_config")
	}
	var s *structpb.Struct
	switch a.MessageName() {
	case "xds.type.v3.TypedStruct":
		ts := new(xdstype.TypedStruct)
		if err := a.UnmarshalTo(ts); err != nil {
			return nil, fmt.Errorf("config: bad TypedStruct: %w", err)
		}
		s = ts.GetValue()
	case "google.protobuf.Struct":
		s = new(structpb.Struct)
		if err := a.UnmarshalTo(s); err != nil {
			return nil, fmt.Errorf("config: bad Struct: %w", err)
		}
	default:
		return nil, fmt.Errorf("config: plugin_config is %s, want xds.type.v3.TypedStruct", a.GetTypeUrl())
	}
	if s == nil {
		return config.FromValue(map[string]any{})
	}
	return config.FromValue(s.AsMap())
}
