package redistest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/certtest"
)

// TLSServer is a private redis-server that accepts TLS connections only
// (no plain-TCP port) and one ACL user; the default user is off. Clients
// need not present a certificate.
type TLSServer struct {
	Addr   string // 127.0.0.1:port, TLS only
	Prefix string // key prefix private to this test
	// CAFile is the PEM CA that signed the server's certificate (issued
	// for 127.0.0.1 and localhost); clients verify against it.
	CAFile             string
	Username, Password string
	PasswordFile       string // holds Password
}

// StartTLS launches a TLS-only redis-server with a fresh CA and ACL user,
// and stops it when the test ends.
func StartTLS(t testing.TB) *TLSServer {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		t.Fatalf("redis-server not on PATH (install Debian's redis-server, or run `make test`): %v", err)
	}
	ca := certtest.NewCA(t, "redistest CA")
	pair := ca.Issue("redis", "127.0.0.1", "localhost")
	dir := t.TempDir()
	port := freePort(t)
	s := &TLSServer{
		Addr: fmt.Sprintf("127.0.0.1:%d", port), Prefix: uniquePrefix(), CAFile: ca.CertFile,
		Username: "mc", Password: "pw-" + uniquePrefix(), PasswordFile: filepath.Join(dir, "password"),
	}
	if err := os.WriteFile(s.PasswordFile, []byte(s.Password+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := spawn(t, "--port", "0", "--tls-port", fmt.Sprint(port), "--bind", "127.0.0.1",
		"--tls-cert-file", pair.CertFile, "--tls-key-file", pair.KeyFile, "--tls-ca-cert-file", ca.CertFile,
		"--tls-auth-clients", "no",
		"--user", s.Username, "on", ">"+s.Password, "~*", "&*", "+@all", "--user", "default", "off",
		"--save", "", "--appendonly", "no", "--dir", dir, "--protected-mode", "no")
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return s
}
