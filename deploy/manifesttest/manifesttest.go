// Package manifesttest decodes the project's Kubernetes and Istio manifests
// strictly, so that a misspelt or misplaced key fails a test instead of being
// dropped silently by the API server (Kubernetes prunes unknown fields) or by
// Istio (its JSON unmarshalers allow unknown fields).
//
// Strict means: duplicate YAML keys fail, every object decodes into its typed
// Go struct with unknown fields refused, and the spec of an Istio object is
// decoded a second time with protojson, which refuses unknown fields the
// generated jsonpb shim lets through.
package manifesttest

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	istioapi "istio.io/api/networking/v1alpha3"
	networkingv1 "istio.io/client-go/pkg/apis/networking/v1"
	networkingv1alpha3 "istio.io/client-go/pkg/apis/networking/v1alpha3"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	netv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	giev1 "sigs.k8s.io/gateway-api-inference-extension/api/v1"
	gatewayv1 "sigs.k8s.io/gateway-api/apis/v1"
	sigsjson "sigs.k8s.io/json"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/api/types"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

// RoutingRulesKind is the local-config document operators edit
// (istio/routing-rules.yaml). kustomize copies its spec into the EnvoyFilter
// and drops it from the output, so no CRD exists for it.
const (
	RoutingRulesAPIVersion = "llm.istio-llm-filter.io/v1alpha1"
	RoutingRulesKind       = "RoutingRules"
)

// RoutingRules is the shape of istio/routing-rules.yaml. The two maps stay
// raw: their meaning is the filter config parser's business.
type RoutingRules struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              RoutingRulesSpec `json:"spec"`
}

// RoutingRulesSpec holds the two keys of the filter document that live in
// routing-rules.yaml.
type RoutingRulesSpec struct {
	ModelMappingRule json.RawMessage `json:"model_mapping_rule"`
	LBMappingRule    json.RawMessage `json:"lb_mapping_rule"`
}

// Document is one YAML document of a file.
type Document struct {
	File  string // path as given to ReadDocuments
	Index int    // 0-based position among the file's non-empty documents
	YAML  []byte
}

func (d Document) String() string { return fmt.Sprintf("%s#%d", d.File, d.Index) }

// ReadDocuments splits a (multi-document) YAML file, skipping documents that
// hold only comments or whitespace.
func ReadDocuments(path string) ([]Document, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return SplitDocuments(path, f)
}

// SplitDocuments is ReadDocuments over a reader; name labels the documents.
func SplitDocuments(name string, r io.Reader) ([]Document, error) {
	yr := utilyaml.NewYAMLReader(bufio.NewReader(r))
	var docs []Document
	for {
		raw, err := yr.Read()
		if errors.Is(err, io.EOF) {
			return docs, nil
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		if isBlank(raw) {
			continue
		}
		docs = append(docs, Document{File: name, Index: len(docs), YAML: raw})
	}
}

func isBlank(doc []byte) bool {
	for _, line := range strings.Split(string(doc), "\n") {
		t := strings.TrimSpace(line)
		if t != "" && t != "---" && !strings.HasPrefix(t, "#") {
			return false
		}
	}
	return true
}

// typeKey is apiVersion + "/" + kind, the decode table's key.
func typeKey(apiVersion, kind string) string { return apiVersion + "/" + kind }

// newObject returns an empty typed object for every kind this project ships.
// A kind missing here is an error, so a new manifest cannot dodge the checks.
func newObject(apiVersion, kind string) (any, bool) {
	switch typeKey(apiVersion, kind) {
	case "v1/Namespace":
		return &corev1.Namespace{}, true
	case "v1/Service":
		return &corev1.Service{}, true
	case "v1/ServiceAccount":
		return &corev1.ServiceAccount{}, true
	case "v1/ConfigMap":
		return &corev1.ConfigMap{}, true
	case "v1/Secret":
		return &corev1.Secret{}, true
	case "v1/PersistentVolumeClaim":
		return &corev1.PersistentVolumeClaim{}, true
	case "apps/v1/Deployment":
		return &appsv1.Deployment{}, true
	case "apps/v1/StatefulSet":
		return &appsv1.StatefulSet{}, true
	case "policy/v1/PodDisruptionBudget":
		return &policyv1.PodDisruptionBudget{}, true
	case "networking.k8s.io/v1/NetworkPolicy":
		return &netv1.NetworkPolicy{}, true
	case "networking.istio.io/v1alpha3/EnvoyFilter":
		return &networkingv1alpha3.EnvoyFilter{}, true
	case "networking.istio.io/v1/Gateway":
		return &networkingv1.Gateway{}, true
	case "networking.istio.io/v1/VirtualService":
		return &networkingv1.VirtualService{}, true
	case "networking.istio.io/v1/DestinationRule":
		return &networkingv1.DestinationRule{}, true
	case "rbac.authorization.k8s.io/v1/Role":
		return &rbacv1.Role{}, true
	case "rbac.authorization.k8s.io/v1/RoleBinding":
		return &rbacv1.RoleBinding{}, true
	case "inference.networking.k8s.io/v1/InferencePool":
		return &giev1.InferencePool{}, true
	case "gateway.networking.k8s.io/v1/Gateway":
		return &gatewayv1.Gateway{}, true
	case "gateway.networking.k8s.io/v1/HTTPRoute":
		return &gatewayv1.HTTPRoute{}, true
	case "kustomize.config.k8s.io/v1beta1/Kustomization":
		return &types.Kustomization{}, true
	case "kustomize.config.k8s.io/v1alpha1/Component":
		return &types.Kustomization{}, true
	case typeKey(RoutingRulesAPIVersion, RoutingRulesKind):
		return &RoutingRules{}, true
	case "monitoring.coreos.com/v1/PodMonitor":
		return &PodMonitor{}, true
	}
	return nil, false
}

// istioSpec returns the proto message an Istio object's spec must decode
// into with protojson, or nil for non-Istio objects.
func istioSpec(obj any) proto.Message {
	switch obj.(type) {
	case *networkingv1alpha3.EnvoyFilter:
		return &istioapi.EnvoyFilter{}
	case *networkingv1.Gateway:
		return &istioapi.Gateway{}
	case *networkingv1.VirtualService:
		return &istioapi.VirtualService{}
	case *networkingv1.DestinationRule:
		return &istioapi.DestinationRule{}
	}
	return nil
}

// Decode decodes one YAML document strictly into its typed object, chosen by
// apiVersion and kind. It returns a pointer such as *appsv1.Deployment.
func Decode(doc []byte) (any, error) {
	js, err := yaml.YAMLToJSONStrict(doc)
	if err != nil {
		return nil, err
	}
	return decodeJSON(js)
}

// DecodePatch is Decode for a strategic-merge patch file: the top-level
// `$patch` directive is not a field of the object, everything else is.
func DecodePatch(doc []byte) (any, error) {
	js, err := yaml.YAMLToJSONStrict(doc)
	if err != nil {
		return nil, err
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(js, &m); err != nil {
		return nil, err
	}
	delete(m, "$patch")
	if js, err = json.Marshal(m); err != nil {
		return nil, err
	}
	return decodeJSON(js)
}

func decodeJSON(js []byte) (any, error) {
	var tm metav1.TypeMeta
	if err := json.Unmarshal(js, &tm); err != nil {
		return nil, err
	}
	if tm.APIVersion == "" || tm.Kind == "" {
		return nil, errors.New("document has no apiVersion/kind")
	}
	obj, ok := newObject(tm.APIVersion, tm.Kind)
	if !ok {
		return nil, fmt.Errorf("no typed decoder for %s %s: add it to manifesttest", tm.APIVersion, tm.Kind)
	}
	if err := decodeStrict(js, obj); err != nil {
		return nil, fmt.Errorf("%s %s: %w", tm.APIVersion, tm.Kind, err)
	}
	if spec := istioSpec(obj); spec != nil {
		var top struct {
			Spec json.RawMessage `json:"spec"`
		}
		if err := json.Unmarshal(js, &top); err != nil {
			return nil, err
		}
		if len(top.Spec) > 0 {
			if err := protojson.Unmarshal(top.Spec, spec); err != nil {
				return nil, fmt.Errorf("%s %s spec: %w", tm.APIVersion, tm.Kind, err)
			}
		}
	}
	return obj, nil
}

// StrictJSON decodes JSON into v the way Decode does: case-sensitive, with
// unknown and duplicate fields refused.
func StrictJSON(js []byte, v any) error { return decodeStrict(js, v) }

// decodeStrict is case-sensitive, unlike encoding/json: "readinessprobe"
// would otherwise fill ReadinessProbe here and then be pruned as unknown by
// the API server, whose decoder is case-sensitive.
func decodeStrict(js []byte, obj any) error {
	strict, err := sigsjson.UnmarshalStrict(js, obj, sigsjson.DisallowDuplicateFields, sigsjson.DisallowUnknownFields)
	if err != nil {
		return err
	}
	return errors.Join(strict...)
}

// Build runs `kustomize build dir` in process, with the same loader
// restrictions the kustomize CLI and `kubectl apply -k` use by default.
func Build(dir string) ([]byte, error) {
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	m, err := k.Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		return nil, err
	}
	return m.AsYaml()
}

// Rendered is one document of a kustomize build, decoded strictly.
type Rendered struct {
	Document
	Object any
}

// BuildDecoded runs Build and decodes every document of its output strictly.
func BuildDecoded(dir string) ([]Rendered, error) {
	out, err := Build(dir)
	if err != nil {
		return nil, fmt.Errorf("kustomize build %s: %w", dir, err)
	}
	docs, err := SplitDocuments(dir, bytes.NewReader(out))
	if err != nil {
		return nil, err
	}
	objs := make([]Rendered, 0, len(docs))
	for _, d := range docs {
		obj, err := Decode(d.YAML)
		if err != nil {
			return nil, fmt.Errorf("kustomize build %s, %s: %w\n%s", dir, d, err, d.YAML)
		}
		objs = append(objs, Rendered{Document: d, Object: obj})
	}
	return objs, nil
}

// YAMLFiles lists every .yaml/.yml file under the roots, sorted.
func YAMLFiles(roots ...string) ([]string, error) {
	var files []string
	for _, root := range roots {
		err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() {
				return nil
			}
			if ext := filepath.Ext(p); ext == ".yaml" || ext == ".yml" {
				files = append(files, p)
			}
			return nil
		})
		if err != nil {
			return nil, err
		}
	}
	sort.Strings(files)
	return files, nil
}

// PatchFiles returns the files that the kustomizations under the roots use as
// patches, keyed by cleaned path: they are partial objects with directives
// and go through DecodePatch.
func PatchFiles(roots ...string) (map[string]bool, error) {
	files, err := YAMLFiles(roots...)
	if err != nil {
		return nil, err
	}
	patches := map[string]bool{}
	for _, f := range files {
		if base := filepath.Base(f); base != "kustomization.yaml" && base != "kustomization.yml" {
			continue
		}
		docs, err := ReadDocuments(f)
		if err != nil {
			return nil, err
		}
		for _, d := range docs {
			obj, err := Decode(d.YAML)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", d, err)
			}
			k := obj.(*types.Kustomization)
			for _, p := range k.Patches {
				if p.Path != "" {
					patches[filepath.Clean(filepath.Join(filepath.Dir(f), p.Path))] = true
				}
			}
			for _, p := range k.PatchesStrategicMerge {
				patches[filepath.Clean(filepath.Join(filepath.Dir(f), string(p)))] = true
			}
		}
	}
	return patches, nil
}

// GeneratorFiles returns the files that the kustomizations under the roots
// turn into ConfigMaps (configMapGenerator files:), keyed by cleaned path:
// configuration data, not objects, checked by their own tests.
func GeneratorFiles(roots ...string) (map[string]bool, error) {
	files, err := YAMLFiles(roots...)
	if err != nil {
		return nil, err
	}
	out := map[string]bool{}
	for _, f := range files {
		if base := filepath.Base(f); base != "kustomization.yaml" && base != "kustomization.yml" {
			continue
		}
		docs, err := ReadDocuments(f)
		if err != nil {
			return nil, err
		}
		for _, d := range docs {
			obj, err := Decode(d.YAML)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", d, err)
			}
			for _, g := range obj.(*types.Kustomization).ConfigMapGenerator {
				for _, src := range g.FileSources {
					if _, path, ok := strings.Cut(src, "="); ok {
						src = path
					}
					out[filepath.Clean(filepath.Join(filepath.Dir(f), src))] = true
				}
			}
		}
	}
	return out, nil
}
