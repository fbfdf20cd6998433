package deploy_test

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
	"testing"

	networkingv1 "istio.io/client-go/pkg/apis/networking/v1"
	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"
)

// apiPath is one path match of the shipped routes: a prefix or an exact
// path.
type apiPath struct{ match, path string }

func (p apiPath) String() string { return p.match + " " + p.path }

// reaches: a request of path takes a route of this match (Istio's prefix
// is a string prefix, the Gateway API's PathPrefix "/v1/" matches the same
// paths below /v1).
func (p apiPath) reaches(path string) bool {
	if p.match == "prefix" {
		return strings.HasPrefix(path, p.path)
	}
	return path == p.path
}

// apiPaths are the paths every route of the shipped gateways (istio/
// gateway.yaml, deploy/inferencepool/gateway.yaml, the chart's
// llmf.apiPaths) sends to the router: the OpenAI-compatible APIs under
// /v1/ and /v2/ (vLLM's /v2/rerank) and the unversioned /rerank and /score
// vLLM serves (docs/envoy-filter.md, "Paths").
var apiPaths = []apiPath{{"prefix", "/v1/"}, {"prefix", "/v2/"}, {"exact", "/rerank"}, {"exact", "/score"}}

func routedPath(path string) bool {
	return slices.ContainsFunc(apiPaths, func(p apiPath) bool { return p.reaches(path) })
}

// Every http route of the VirtualService matches exactly apiPaths, each
// path with the route's one header condition, and no match is named:
// Istio names an Envoy route "<route>.<match>" when the match has a name,
// and the EnvoyFilter's patch of llm-routed must reach every path's route.
func checkVirtualServicePaths(t *testing.T, vs *networkingv1.VirtualService) {
	t.Helper()
	for _, r := range vs.Spec.Http {
		var got []apiPath
		var hdrs []string
		for _, m := range r.Match {
			if m.Name != "" {
				t.Errorf("route %q: match named %q: its Envoy route is not %q, the EnvoyFilter would not patch it", r.Name, m.Name, r.Name)
			}
			switch {
			case m.GetUri().GetPrefix() != "":
				got = append(got, apiPath{"prefix", m.GetUri().GetPrefix()})
			case m.GetUri().GetExact() != "":
				got = append(got, apiPath{"exact", m.GetUri().GetExact()})
			default:
				t.Errorf("route %q: a match of no prefix or exact path: %v", r.Name, m.GetUri())
			}
			var hs []string
			for k, v := range m.Headers {
				hs = append(hs, fmt.Sprintf("%s exact=%q regex=%q prefix=%q", k, v.GetExact(), v.GetRegex(), v.GetPrefix()))
			}
			slices.Sort(hs)
			hdrs = append(hdrs, strings.Join(hs, "; "))
		}
		if !slices.Equal(got, apiPaths) {
			t.Errorf("route %q matches %v, want %v", r.Name, got, apiPaths)
		}
		if len(slices.Compact(slices.Clone(hdrs))) > 1 {
			t.Errorf("route %q: the paths' header conditions differ: %v", r.Name, hdrs)
		}
	}
}

// The HTTPRoute to the InferencePool matches exactly apiPaths.
func checkHTTPRoutePaths(t *testing.T, route *gatewayv1.HTTPRoute) {
	t.Helper()
	for _, r := range route.Spec.Rules {
		var got []apiPath
		for _, m := range r.Matches {
			if m.Path == nil || m.Path.Type == nil || m.Path.Value == nil {
				t.Errorf("HTTPRoute %s: a match without a path", route.Name)
				continue
			}
			switch *m.Path.Type {
			case gatewayv1.PathMatchPathPrefix:
				got = append(got, apiPath{"prefix", *m.Path.Value})
			case gatewayv1.PathMatchExact:
				got = append(got, apiPath{"exact", *m.Path.Value})
			default:
				t.Errorf("HTTPRoute %s: path match %s", route.Name, *m.Path.Type)
			}
		}
		if !slices.Equal(got, apiPaths) {
			t.Errorf("HTTPRoute %s matches %v, want %v", route.Name, got, apiPaths)
		}
	}
}

// docs/envoy-filter.md's table of paths and the shipped routes agree:
// the page names the routes' paths as apiPaths has them, and every path it
// lists as served (a suffix alone being under /v1) is one they reach.
func TestEnvoyFilterDocPathsAreRouted(t *testing.T) {
	doc := readDoc(t, "envoy-filter.md")
	_, sec, ok := strings.Cut(doc, "\n## Paths\n")
	if !ok {
		t.Fatal(`docs/envoy-filter.md has no "## Paths" section`)
	}
	sec, _, _ = strings.Cut(sec, "\n## ")

	var prefixes, exact []string
	for _, p := range apiPaths {
		if p.match == "prefix" {
			prefixes = append(prefixes, "`"+p.path+"`")
		} else {
			exact = append(exact, "`"+p.path+"`")
		}
	}
	want := fmt.Sprintf("the prefixes %s and the exact paths %s", strings.Join(prefixes, " and "), strings.Join(exact, " and "))
	if !strings.Contains(strings.Join(strings.Fields(sec), " "), want) {
		t.Errorf("the Paths section does not name the routes' paths as %q", want)
	}

	token := regexp.MustCompile("`(/[^`]*)`")
	rows := 0
	for _, line := range strings.Split(sec, "\n") {
		if !strings.HasPrefix(line, "| `/") {
			continue
		}
		rows++
		cell := strings.Split(line, "|")[1]
		suffixes, listed, _ := strings.Cut(cell, "(")
		for _, m := range token.FindAllStringSubmatch(suffixes, -1) {
			if p := "/v1" + m[1]; !routedPath(p) {
				t.Errorf("%s (the table's %s) is not routed by the shipped routes %v", p, m[1], apiPaths)
			}
		}
		for _, m := range token.FindAllStringSubmatch(listed, -1) {
			if !routedPath(m[1]) {
				t.Errorf("%s, listed in the table, is not routed by the shipped routes %v", m[1], apiPaths)
			}
		}
	}
	if rows < 8 {
		t.Fatalf("%d rows of paths in the table, want every API's", rows)
	}
}
