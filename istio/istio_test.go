// Tests of the Istio side as kustomize renders it: the EnvoyFilter's
// plugin_config goes through the filter's real config parser exactly as Envoy
// hands it over (an Any holding an xds.type.v3.TypedStruct), the routing rules
// file ends up in it, and a bad rules file is refused by that parser.
package istio_test

import (
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	xdstype "github.com/cncf/xds/go/xds/type/v3"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
	istioapi "istio.io/api/networking/v1alpha3"
	networkingv1alpha3 "istio.io/client-go/pkg/apis/networking/v1alpha3"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/istio-llm-filter/istio-llm-filter/deploy/manifesttest"
	"github.com/istio-llm-filter/istio-llm-filter/filter/config"
	"github.com/istio-llm-filter/istio-llm-filter/filter/config/envoyconfig"
)

// Names the filter's registration and the gateway image agree on.
const (
	pluginName  = "llm-filter" // filter/llmfilter.Name, registered by filter/cmd/llm-filter
	libraryID   = "llm-filter"
	golangType  = "type.googleapis.com/envoy.extensions.filters.http.golang.v3alpha.Config"
	typedStruct = "type.googleapis.com/xds.type.v3.TypedStruct"
)

// golangFilterConfig mirrors envoy.extensions.filters.http.golang.v3alpha.Config
// of Envoy 1.36 (api/contrib/envoy/extensions/filters/http/golang/v3alpha/
// golang.proto; golang_filter.cc reads the same fields); its generated Go type
// lives in go-control-plane, which this module does not depend on. Decoded
// with unknown fields refused, so a typo in the patch fails here rather than
// in Envoy's xDS rejection log.
type golangFilterConfig struct {
	Type           string          `json:"@type"`
	LibraryID      string          `json:"library_id"`
	LibraryPath    string          `json:"library_path"`
	PluginName     string          `json:"plugin_name"`
	PluginConfig   json.RawMessage `json:"plugin_config"`
	MergePolicy    string          `json:"merge_policy,omitempty"`
	GenericSecrets json.RawMessage `json:"generic_secrets,omitempty"`
}

type httpFilter struct {
	Name        string             `json:"name"`
	TypedConfig golangFilterConfig `json:"typed_config"`
}

type typedStructJSON struct {
	Type    string         `json:"@type"`
	TypeURL string         `json:"type_url"`
	Value   map[string]any `json:"value"`
}

type listenerPatch struct {
	PerConnectionBufferLimitBytes uint32 `json:"per_connection_buffer_limit_bytes"`
}

func strictJSON(t *testing.T, js []byte, v any) {
	t.Helper()
	if err := manifesttest.StrictJSON(js, v); err != nil {
		t.Fatalf("%T: %v\n%s", v, err, js)
	}
}

// rendered is the EnvoyFilter of one kustomize build of an istio directory.
type rendered struct {
	filter   *networkingv1alpha3.EnvoyFilter
	listener *istioapi.EnvoyFilter_EnvoyConfigObjectPatch
	http     *istioapi.EnvoyFilter_EnvoyConfigObjectPatch
	kinds    []string
}

func render(t *testing.T, dir string) rendered {
	t.Helper()
	objs, err := manifesttest.BuildDecoded(dir)
	if err != nil {
		t.Fatal(err)
	}
	var r rendered
	for _, o := range objs {
		r.kinds = append(r.kinds, reflect.TypeOf(o.Object).Elem().Name())
		if ef, ok := o.Object.(*networkingv1alpha3.EnvoyFilter); ok {
			r.filter = ef
		}
	}
	if r.filter == nil {
		t.Fatal("no EnvoyFilter in the build")
	}
	for _, p := range r.filter.Spec.ConfigPatches {
		switch p.GetApplyTo() {
		case istioapi.EnvoyFilter_LISTENER:
			r.listener = p
		case istioapi.EnvoyFilter_HTTP_FILTER:
			r.http = p
		}
	}
	if r.listener == nil || r.http == nil {
		t.Fatalf("want a LISTENER and an HTTP_FILTER patch, got %v", r.filter.Spec.ConfigPatches)
	}
	return r
}

// pluginAny builds plugin_config the way Envoy passes it to the Go plugin:
// the TypedStruct, packed in an Any.
func (r rendered) pluginAny(t *testing.T) (*anypb.Any, httpFilter) {
	t.Helper()
	js, err := r.http.GetPatch().GetValue().MarshalJSON()
	if err != nil {
		t.Fatal(err)
	}
	var hf httpFilter
	strictJSON(t, js, &hf)
	var ts typedStructJSON
	strictJSON(t, hf.TypedConfig.PluginConfig, &ts)
	if ts.Type != typedStruct {
		t.Fatalf("plugin_config @type = %q, want %q", ts.Type, typedStruct)
	}
	if ts.TypeURL == "" {
		t.Fatal("TypedStruct without type_url")
	}
	value, err := structpb.NewStruct(ts.Value)
	if err != nil {
		t.Fatal(err)
	}
	a, err := anypb.New(&xdstype.TypedStruct{TypeUrl: ts.TypeURL, Value: value})
	if err != nil {
		t.Fatal(err)
	}
	return a, hf
}

func TestEnvoyFilterInsertsTheGolangFilterBeforeTheRouter(t *testing.T) {
	r := render(t, ".")
	if got := r.filter.Spec.GetWorkloadSelector().GetLabels()["istio"]; got != "ingressgateway" {
		t.Errorf("workloadSelector istio=%q, want ingressgateway", got)
	}
	p := r.http
	if p.GetMatch().GetContext() != istioapi.EnvoyFilter_GATEWAY {
		t.Errorf("context %v, want GATEWAY", p.GetMatch().GetContext())
	}
	fc := p.GetMatch().GetListener().GetFilterChain().GetFilter()
	if fc.GetName() != "envoy.filters.network.http_connection_manager" || fc.GetSubFilter().GetName() != "envoy.filters.http.router" {
		t.Errorf("match %v, want the router of the HTTP connection manager", fc)
	}
	if p.GetPatch().GetOperation() != istioapi.EnvoyFilter_Patch_INSERT_BEFORE {
		t.Errorf("operation %v, want INSERT_BEFORE", p.GetPatch().GetOperation())
	}
	_, hf := r.pluginAny(t)
	if hf.Name != "envoy.filters.http.golang" || hf.TypedConfig.Type != golangType {
		t.Errorf("filter %q of type %q, want envoy.filters.http.golang / %s", hf.Name, hf.TypedConfig.Type, golangType)
	}
	if hf.TypedConfig.PluginName != pluginName || hf.TypedConfig.LibraryID != libraryID {
		t.Errorf("plugin_name %q library_id %q, want %q / %q", hf.TypedConfig.PluginName, hf.TypedConfig.LibraryID, pluginName, libraryID)
	}
	if !filepath.IsAbs(hf.TypedConfig.LibraryPath) || filepath.Ext(hf.TypedConfig.LibraryPath) != ".so" {
		t.Errorf("library_path %q: want an absolute path to a .so", hf.TypedConfig.LibraryPath)
	}
}

func TestPluginConfigGoesThroughTheRealParser(t *testing.T) {
	r := render(t, ".")
	a, _ := r.pluginAny(t)
	cfg, err := envoyconfig.Parse(a)
	if err != nil {
		t.Fatalf("the filter refuses the EnvoyFilter's plugin_config: %v", err)
	}

	// The rules are the ones in routing-rules.yaml, as the parser reads them.
	docs, err := manifesttest.ReadDocuments("routing-rules.yaml")
	if err != nil {
		t.Fatal(err)
	}
	obj, err := manifesttest.Decode(docs[0].YAML)
	if err != nil {
		t.Fatal(err)
	}
	rr := obj.(*manifesttest.RoutingRules)
	rulesOnly, err := json.Marshal(map[string]json.RawMessage{
		"model_mapping_rule": rr.Spec.ModelMappingRule,
		"lb_mapping_rule":    rr.Spec.LBMappingRule,
	})
	if err != nil {
		t.Fatal(err)
	}
	want, err := config.Parse(rulesOnly)
	if err != nil {
		t.Fatalf("routing-rules.yaml refused by the parser: %v", err)
	}
	if !reflect.DeepEqual(cfg.ModelMappingRule, want.ModelMappingRule) {
		t.Errorf("model_mapping_rule in the EnvoyFilter = %+v, routing-rules.yaml says %+v", cfg.ModelMappingRule, want.ModelMappingRule)
	}
	if !reflect.DeepEqual(cfg.LBMappingRule, want.LBMappingRule) {
		t.Errorf("lb_mapping_rule in the EnvoyFilter = %+v, routing-rules.yaml says %+v", cfg.LBMappingRule, want.LBMappingRule)
	}

	if cfg.Protocol != "openai" {
		t.Errorf("protocol %q", cfg.Protocol)
	}
	// In the mesh the endpoints come from the gateway's own Envoy admin
	// (Istio's proxy admin port), never from static lists.
	if cfg.Endpoints.EnvoyAdmin == nil || cfg.Endpoints.EnvoyAdmin.Address != "http://127.0.0.1:15000" || len(cfg.Endpoints.Static) != 0 {
		t.Errorf("endpoints %+v, want envoy_admin at 127.0.0.1:15000 only", cfg.Endpoints)
	}
	// The metadata center address names the Service deploy/ creates.
	if cfg.MetadataCenter.Address != "http://metadata-center.llm.svc.cluster.local:8080" {
		t.Errorf("metadata_center.address %q", cfg.MetadataCenter.Address)
	}
	// The token is read from a mounted Secret: the EnvoyFilter names the
	// file, never the token (deploy's TestAuthTokenIsAMountedSecret checks
	// the gateway mounts it there).
	if cfg.MetadataCenter.AuthToken != "" || cfg.MetadataCenter.AuthTokenFile != "/etc/llm-filter/mc-auth/token" {
		t.Errorf("metadata_center auth_token %q, auth_token_file %q: want only the file", cfg.MetadataCenter.AuthToken, cfg.MetadataCenter.AuthTokenFile)
	}
	svcDocs, err := manifesttest.ReadDocuments("../deploy/base/metadata-center.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var found bool
	for _, d := range svcDocs {
		o, err := manifesttest.Decode(d.YAML)
		if err != nil {
			t.Fatal(err)
		}
		if svc, ok := o.(*corev1.Service); ok && svc.Name == "metadata-center" && svc.Namespace == "llm" {
			for _, p := range svc.Spec.Ports {
				found = found || p.Port == 8080
			}
		}
	}
	if !found {
		t.Error("deploy/base has no Service llm/metadata-center on port 8080")
	}
}

// Envoy answers a body over the connection's buffer limit with its own 413
// before the filter sees it; the limit must be at least the filter's own
// max_body_bytes, so that oversized prompts get the filter's JSON error.
func TestListenerBufferHoldsTheFiltersLargestBody(t *testing.T) {
	r := render(t, ".")
	if r.listener.GetMatch().GetContext() != istioapi.EnvoyFilter_GATEWAY {
		t.Errorf("LISTENER patch context %v, want GATEWAY", r.listener.GetMatch().GetContext())
	}
	if r.listener.GetPatch().GetOperation() != istioapi.EnvoyFilter_Patch_MERGE {
		t.Errorf("LISTENER patch operation %v, want MERGE", r.listener.GetPatch().GetOperation())
	}
	js, err := r.listener.GetPatch().GetValue().MarshalJSON()
	if err != nil {
		t.Fatal(err)
	}
	var lp listenerPatch
	strictJSON(t, js, &lp)
	a, _ := r.pluginAny(t)
	cfg, err := envoyconfig.Parse(a)
	if err != nil {
		t.Fatal(err)
	}
	if int64(lp.PerConnectionBufferLimitBytes) < int64(cfg.MaxBodyBytes) {
		t.Errorf("per_connection_buffer_limit_bytes %d < max_body_bytes %d", lp.PerConnectionBufferLimitBytes, cfg.MaxBodyBytes)
	}
	if lp.PerConnectionBufferLimitBytes <= 1<<20 {
		t.Errorf("per_connection_buffer_limit_bytes %d is not above Envoy's 1 MiB default", lp.PerConnectionBufferLimitBytes)
	}
}

// The rules document is kustomize input only: the API server has no such kind.
func TestRoutingRulesDocumentIsNotApplied(t *testing.T) {
	r := render(t, ".")
	for _, k := range r.kinds {
		if k == "RoutingRules" {
			t.Fatal("RoutingRules reached the build output; it must stay local config")
		}
	}
}

// copyDir copies the istio directory so a test can edit the rules file.
func copyDir(t *testing.T, src string) string {
	t.Helper()
	dst := t.TempDir()
	entries, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.IsDir() || filepath.Ext(e.Name()) != ".yaml" {
			continue
		}
		b, err := os.ReadFile(filepath.Join(src, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dst, e.Name()), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dst
}

// An operator's mistake in routing-rules.yaml must be caught by the parser
// the filter runs, with the key path in the message.
func TestBadRoutingRulesAreRefused(t *testing.T) {
	cases := map[string]struct {
		edit func(spec map[string]any)
		want string
	}{
		"candidate_percent out of range": {
			edit: func(s map[string]any) {
				s["lb_mapping_rule"].(map[string]any)["default"].(map[string]any)["candidate_percent"] = 0
			},
			want: "lb_mapping_rule.default.candidate_percent: must be in 1..100",
		},
		"unknown backend": {
			edit: func(s map[string]any) {
				s["model_mapping_rule"].(map[string]any)["tiny"].([]any)[0].(map[string]any)["backend"] = "ollama"
			},
			want: "model_mapping_rule.tiny[0].backend: must be one of",
		},
		"misspelt key": {
			edit: func(s map[string]any) {
				s["model_mapping_rule"].(map[string]any)["tiny"].([]any)[0].(map[string]any)["clustr"] = "x"
			},
			want: "model_mapping_rule.tiny[0].clustr: unknown key",
		},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			dir := copyDir(t, ".")
			path := filepath.Join(dir, "routing-rules.yaml")
			b, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			var doc map[string]any
			if err := yaml.Unmarshal(b, &doc); err != nil {
				t.Fatal(err)
			}
			tc.edit(doc["spec"].(map[string]any))
			if b, err = yaml.Marshal(doc); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(path, b, 0o644); err != nil {
				t.Fatal(err)
			}
			a, _ := render(t, dir).pluginAny(t)
			_, err = envoyconfig.Parse(a)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("envoyconfig.Parse error = %v, want one containing %q", err, tc.want)
			}
		})
	}
}
