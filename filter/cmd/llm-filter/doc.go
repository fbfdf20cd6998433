// Command llm-filter is the shared library Envoy's golang HTTP filter
// (envoy.filters.http.golang, plugin name "llm-filter") loads:
//
//	go build -tags envoy -buildmode=c-shared -o bin/llm-filter.so ./filter/cmd/llm-filter
//
// (make filter-so). The registration lives in main.go under the `envoy` build
// tag because Envoy's cgo shim (filters/http/source/go/pkg/http) calls into C
// from its init and would crash any ordinary binary or test that imported it;
// without the tag this package is an empty program, so `go build ./...` and
// `go vet ./...` still cover it.
package main

// main is never called: in c-shared mode the Go runtime starts on dlopen and
// Envoy calls the exported envoyGo* functions.
func main() {}
