package istio_test

import (
	"os"
	"testing"

	bootstrapv3 "github.com/envoyproxy/go-control-plane/envoy/config/bootstrap/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	_ "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/router/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	istioapi "istio.io/api/networking/v1alpha3"

	"github.com/istio-llm-filter/istio-llm-filter/filter/epp/envoyrun"
)

// gatewayBootstrap is what Istio generates for the ingress gateway of
// istio/gateway.yaml, reduced to what the EnvoyFilter patches: a listener
// whose connection manager ends in the router, with the llm-routed route.
const gatewayBootstrap = `{
  "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}}},
  "static_resources": {
    "listeners": [{
      "name": "0.0.0.0_8080",
      "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
      "filter_chains": [{"filters": [{
        "name": "envoy.filters.network.http_connection_manager",
        "typed_config": {
          "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
          "stat_prefix": "outbound_0.0.0.0_8080",
          "route_config": {"name": "http.8080", "virtual_hosts": [{"name": "llm", "domains": ["*"],
            "routes": [{"name": "llm-routed", "match": {"prefix": "/v1/"},
              "route": {"cluster": "outbound|8000||workers.llm.svc.cluster.local"}}]}]},
          "http_filters": [{"name": "envoy.filters.http.router",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
        }
      }]}]
    }],
    "clusters": [{"name": "outbound|8000||workers.llm.svc.cluster.local", "type": "STATIC", "connect_timeout": "1s",
      "load_assignment": {"cluster_name": "outbound|8000||workers.llm.svc.cluster.local", "endpoints": [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": 8000}}}}]}]}}]
  }
}`

// The upstream Envoy validates every patch of the EnvoyFilter that its
// build knows, applied to the gateway's configuration as Istio merges
// them (proto merge; typed_config unpacked): all but the golang HTTP
// filter, a contrib extension absent from the upstream build (the .so's
// own tests run it, envoyhost/).
func TestEnvoyFilterPatchesValidateInUpstreamEnvoy(t *testing.T) {
	bin, err := envoyrun.Binary()
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI needs the real Envoy: %v", err)
		}
		t.Skipf("no Envoy binary: %v", err)
	}
	r := render(t, ".")
	boot := &bootstrapv3.Bootstrap{}
	if err := protojson.Unmarshal([]byte(gatewayBootstrap), boot); err != nil {
		t.Fatal(err)
	}
	lis := boot.StaticResources.Listeners[0]
	hcmFilter := lis.FilterChains[0].Filters[0]
	hcm := &hcmv3.HttpConnectionManager{}
	if err := hcmFilter.GetTypedConfig().UnmarshalTo(hcm); err != nil {
		t.Fatal(err)
	}
	applied := map[istioapi.EnvoyFilter_ApplyTo]int{}
	for _, p := range r.filter.Spec.ConfigPatches {
		js, err := p.GetPatch().GetValue().MarshalJSON()
		if err != nil {
			t.Fatal(err)
		}
		into := func(dst proto.Message) {
			t.Helper()
			src := dst.ProtoReflect().New().Interface()
			if err := protojson.Unmarshal(js, src); err != nil {
				t.Fatalf("%v patch: %v\n%s", p.GetApplyTo(), err, js)
			}
			proto.Merge(dst, src)
		}
		if op := p.GetPatch().GetOperation(); op != istioapi.EnvoyFilter_Patch_MERGE && p.GetApplyTo() != istioapi.EnvoyFilter_HTTP_FILTER {
			t.Fatalf("%v patch: operation %v; this test applies MERGE only", p.GetApplyTo(), op)
		}
		switch p.GetApplyTo() {
		case istioapi.EnvoyFilter_BOOTSTRAP:
			into(boot)
		case istioapi.EnvoyFilter_LISTENER:
			into(lis)
		case istioapi.EnvoyFilter_NETWORK_FILTER:
			// Istio merges a filter's typed_config inside its Any.
			f := &listenerv3.Filter{}
			if err := protojson.Unmarshal(js, f); err != nil {
				t.Fatal(err)
			}
			patch := &hcmv3.HttpConnectionManager{}
			if err := f.GetTypedConfig().UnmarshalTo(patch); err != nil {
				t.Fatal(err)
			}
			proto.Merge(hcm, patch)
		case istioapi.EnvoyFilter_HTTP_ROUTE:
			for _, vh := range hcm.GetRouteConfig().GetVirtualHosts() {
				for _, rt := range vh.Routes {
					if rt.Name == p.GetMatch().GetRouteConfiguration().GetVhost().GetRoute().GetName() {
						into(rt)
					}
				}
			}
		case istioapi.EnvoyFilter_HTTP_FILTER:
			continue // the golang filter: not in the upstream build
		default:
			t.Fatalf("a %v patch this test does not apply", p.GetApplyTo())
		}
		applied[p.GetApplyTo()]++
	}
	if len(applied) < 4 {
		t.Fatalf("only %v were applied", applied)
	}
	var route *routev3.Route
	for _, vh := range hcm.GetRouteConfig().GetVirtualHosts() {
		route = vh.Routes[0]
	}
	if route.GetRoute().GetClusterHeader() == "" {
		t.Fatalf("the route patch did not apply: %v", route)
	}
	a, err := anypb.New(hcm)
	if err != nil {
		t.Fatal(err)
	}
	hcmFilter.ConfigType = &listenerv3.Filter_TypedConfig{TypedConfig: a}
	doc, err := protojson.Marshal(boot)
	if err != nil {
		t.Fatal(err)
	}
	if err := envoyrun.Validate(bin, string(doc)); err != nil {
		t.Fatal(err)
	}
	t.Logf("validated: %v", applied)
}
