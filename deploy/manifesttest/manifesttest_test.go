package manifesttest

import (
	"strings"
	"testing"

	networkingv1 "istio.io/client-go/pkg/apis/networking/v1"
	appsv1 "k8s.io/api/apps/v1"
)

// The decoder is only worth something if it refuses what the API server or
// Istio would silently drop; each case is a mistake that has bitten people.
func TestDecodeRefusesWhatWouldBeDropped(t *testing.T) {
	cases := map[string]struct {
		doc  string
		want string // substring of the error
	}{
		"misspelt field in a Deployment": {`
apiVersion: apps/v1
kind: Deployment
metadata: {name: x}
spec:
  replicas: 1
  template:
    spec:
      containers:
        - name: c
          image: i
          readinessprobe: {}
`, `unknown field "spec.template.spec.containers[0].readinessprobe"`},
		"field at the wrong level": {`
apiVersion: v1
kind: Service
metadata: {name: x}
ports: [{port: 80}]
`, `unknown field "ports"`},
		"duplicate key": {`
apiVersion: v1
kind: Service
metadata: {name: x}
spec: {}
spec: {}
`, `already set in map`},
		"unknown field inside an Istio spec (jsonpb shim allows it)": {`
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: x}
spec:
  hosts: ["*"]
  http:
    - route: [{destination: {host: a}}]
      retry: {attempts: 0}
`, `unknown field "retry"`},
		"unknown enum value in an EnvoyFilter": {`
apiVersion: networking.istio.io/v1alpha3
kind: EnvoyFilter
metadata: {name: x}
spec:
  configPatches:
    - applyTo: HTTP_FILTERS
      patch: {operation: MERGE, value: {}}
`, `HTTP_FILTERS`},
		"kind without a typed decoder": {`
apiVersion: example.com/v1
kind: Widget
metadata: {name: x}
`, `no typed decoder`},
		"no kind": {`
metadata: {name: x}
`, `no apiVersion/kind`},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := Decode([]byte(tc.doc))
			if err == nil {
				t.Fatalf("decoded without error; want error containing %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not contain %q", err, tc.want)
			}
		})
	}
}

func TestDecodeReturnsTypedObjects(t *testing.T) {
	obj, err := Decode([]byte(`
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: ns}
spec:
  replicas: 3
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      containers: [{name: c, image: "i:1", args: ["--listen=:80"]}]
`))
	if err != nil {
		t.Fatal(err)
	}
	d, ok := obj.(*appsv1.Deployment)
	if !ok {
		t.Fatalf("got %T, want *appsv1.Deployment", obj)
	}
	if d.Name != "web" || *d.Spec.Replicas != 3 || d.Spec.Template.Spec.Containers[0].Args[0] != "--listen=:80" {
		t.Fatalf("decoded wrong content: %+v", d)
	}

	obj, err = Decode([]byte(`
apiVersion: networking.istio.io/v1
kind: VirtualService
metadata: {name: vs}
spec:
  hosts: ["*"]
  http:
    - match: [{uri: {prefix: /v1/}}]
      route: [{destination: {host: a.b.svc.cluster.local, port: {number: 8000}}}]
      retries: {attempts: 0}
`))
	if err != nil {
		t.Fatal(err)
	}
	vs := obj.(*networkingv1.VirtualService)
	if got := vs.Spec.Http[0].Route[0].Destination.Port.Number; got != 8000 {
		t.Fatalf("port = %d, want 8000", got)
	}
}

func TestDecodePatchAcceptsOnlyTheDirective(t *testing.T) {
	if _, err := DecodePatch([]byte("$patch: delete\napiVersion: v1\nkind: Service\nmetadata: {name: redis}\n")); err != nil {
		t.Fatalf("delete patch refused: %v", err)
	}
	if _, err := DecodePatch([]byte("$patch: delete\napiVersion: v1\nkind: Service\nmetadata: {name: redis}\nspc: {}\n")); err == nil {
		t.Fatal("unknown field next to the directive accepted")
	}
	if _, err := Decode([]byte("$patch: delete\napiVersion: v1\nkind: Service\nmetadata: {name: redis}\n")); err == nil {
		t.Fatal("Decode accepted a patch directive in a manifest")
	}
}

func TestSplitDocumentsSkipsCommentOnlyDocuments(t *testing.T) {
	in := "# header comment\n---\napiVersion: v1\nkind: Namespace\nmetadata: {name: a}\n---\n# nothing\n---\napiVersion: v1\nkind: Namespace\nmetadata: {name: b}\n"
	docs, err := SplitDocuments("in.yaml", strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	if len(docs) != 2 {
		t.Fatalf("got %d documents, want 2", len(docs))
	}
	if !strings.Contains(string(docs[1].YAML), "name: b") || docs[1].String() != "in.yaml#1" {
		t.Fatalf("second document wrong: %s %q", docs[1], docs[1].YAML)
	}
}
