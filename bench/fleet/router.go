package fleet

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"strings"
)

// RouterCommand is a router of another make to run in place of our gateway
// (bench --external): Command is one shell command, run by /bin/sh as
// `exec Command` (so the fleet stops the router itself, not a shell), with
// these placeholders replaced:
//
//	{workers}       the fleet's pods, base URLs separated by spaces (http://127.0.0.1:41234 …)
//	{workers_csv}   the same, separated by commas
//	{port}          a free loopback port the router must listen on
//	{metrics_port}  another free port, for a router that opens a metrics listener of its own
//
// Env is added to the router's environment.
type RouterCommand struct {
	Name    string
	Command string
	Env     []string
}

// StartRouter starts r against the fleet's pods and makes it the fleet's
// gateway: clients send to it as to ours. It is ready once GET /v1/models
// answers 200, which an OpenAI-compatible router can do only once it
// reaches a pod. Its output goes to <LogDir>/<Name>.log; Stop stops it.
func (f *Fleet) StartRouter(ctx context.Context, r RouterCommand) (string, error) {
	if !strings.Contains(r.Command, "{port}") {
		return "", fmt.Errorf("router %s: the command has no {port}: the bench cannot tell where it listens", r.Name)
	}
	port, err := freePort()
	if err != nil {
		return "", err
	}
	metrics, err := freePort()
	if err != nil {
		return "", err
	}
	urls := make([]string, len(f.Workers))
	for i, w := range f.Workers {
		urls[i] = "http://" + w
	}
	line := strings.NewReplacer("{workers}", strings.Join(urls, " "), "{workers_csv}", strings.Join(urls, ","),
		"{port}", port, "{metrics_port}", metrics).Replace(r.Command)
	p, err := f.spawnEnv(f.spec, "/bin/sh", r.Name, r.Env, "-c", "exec "+line)
	if err != nil {
		return "", err
	}
	base := "http://127.0.0.1:" + port
	if err := waitAnswering(ctx, base+"/v1/models", p); err != nil {
		return "", fmt.Errorf("router %s (%s): %w, see %s", r.Name, line, err, filepath.Join(f.LogDir, r.Name+".log"))
	}
	f.Gateway, f.Gateways = base, []string{base}
	return base, nil
}

func freePort() (string, error) {
	a, err := freeAddr()
	if err != nil {
		return "", err
	}
	_, port, err := net.SplitHostPort(a)
	return port, err
}
