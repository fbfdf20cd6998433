package secretfile

import (
	"crypto/tls"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/certtest"
)

// clock is a manual clock for the look-again interval.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time { c.mu.Lock(); defer c.mu.Unlock(); return c.t }
func (c *clock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// replace swaps path's content the way kubelet does: a new file renamed
// over the old one.
func replace(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".new"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func TestClientTokenRotates(t *testing.T) {
	path := filepath.Join(t.TempDir(), "token")
	replace(t, path, "  first\nolder\n")
	clk := &clock{t: time.Unix(1000, 0)}
	tok, err := ClientToken(path, Options[string]{Every: 10 * time.Second, Now: clk.now})
	if err != nil {
		t.Fatal(err)
	}
	if got := tok.Get(); got != "first" {
		t.Fatalf("token %q, want the first line", got)
	}
	replace(t, path, "second\n")
	if got := tok.Get(); got != "first" {
		t.Fatalf("looked again before the interval: %q", got)
	}
	clk.add(10 * time.Second)
	if got := tok.Get(); got != "second" {
		t.Fatalf("after the interval: %q, want second", got)
	}
	// A bad content keeps the last good token.
	replace(t, path, "has blank\n")
	clk.add(10 * time.Second)
	if got := tok.Get(); got != "second" {
		t.Fatalf("bad content replaced the token: %q", got)
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	clk.add(10 * time.Second)
	if got := tok.Get(); got != "" {
		t.Fatalf("removed file still gives %q", got)
	}
	if _, err := ClientToken(filepath.Join(t.TempDir(), "absent"), Options[string]{}); err != nil {
		t.Fatalf("an absent file is no token, not an error: %v", err)
	}
}

func TestServerTokensGraceAndRecheck(t *testing.T) {
	path := filepath.Join(t.TempDir(), "token")
	clk := &clock{t: time.Unix(1000, 0)}
	ts, err := ServerTokens(path, time.Minute, Options[[]string]{Every: 10 * time.Second, Now: clk.now})
	if err != nil {
		t.Fatal(err)
	}
	if ts.Enabled() || !ts.Accept("") {
		t.Fatal("no file must mean authentication off")
	}
	replace(t, path, "old\n")
	clk.add(10 * time.Second)
	if !ts.Enabled() || ts.Accept("") || ts.Accept("nope") || !ts.Accept("old") {
		t.Fatal("the file's token is not enforced")
	}
	// Two tokens: both accepted.
	replace(t, path, "new\nold\n")
	clk.add(10 * time.Second)
	if !ts.Accept("new") || !ts.Accept("old") || ts.Accept("ol") {
		t.Fatal("a two-token file is not honoured")
	}
	// The old token is dropped: still accepted within the grace period.
	replace(t, path, "new\n")
	clk.add(10 * time.Second)
	if !ts.Accept("new") || !ts.Accept("old") {
		t.Fatal("the previous token is refused within the grace period")
	}
	clk.add(time.Minute)
	if ts.Accept("old") {
		t.Fatal("the previous token is accepted after the grace period")
	}
	// A client ahead of the server: its token is refused once, the file is
	// looked at again (at most every second) and the token accepted.
	replace(t, path, "newer\n")
	clk.add(time.Second)
	if !ts.Accept("newer") {
		t.Fatal("a refused token did not make the server look at the file again")
	}
}

func TestServerTLSReloadsAndClientVerifies(t *testing.T) {
	ca := certtest.NewCA(t, "test CA")
	pair := ca.Issue("mc", "127.0.0.1")
	dir := t.TempDir()
	certFile, keyFile := filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key")
	install := func(p certtest.Pair) {
		for src, dst := range map[string]string{p.CertFile: certFile, p.KeyFile: keyFile} {
			b, err := os.ReadFile(src)
			if err != nil {
				t.Fatal(err)
			}
			replace(t, dst, string(b))
		}
	}
	install(pair)
	clk := &clock{t: time.Unix(1000, 0)}
	scfg, err := ServerTLS(certFile, keyFile, Options[*tls.Certificate]{Now: clk.now})
	if err != nil {
		t.Fatal(err)
	}
	// Not httptest's StartTLS: it would add its own certificate.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}), ErrorLog: log.New(io.Discard, "", 0)}
	go func() { _ = hs.Serve(tls.NewListener(ln, scfg)) }()
	defer hs.Close()
	url := "https://" + ln.Addr().String()

	ccfg, err := ClientTLS(ca.CertFile, "", false)
	if err != nil {
		t.Fatal(err)
	}
	serial := func() string {
		t.Helper()
		hc := &http.Client{Transport: &http.Transport{TLSClientConfig: ccfg, DisableKeepAlives: true}}
		resp, err := hc.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.TLS.PeerCertificates[0].Subject.CommonName
	}
	if got := serial(); got != "mc" {
		t.Fatalf("served %q", got)
	}
	install(ca.Issue("mc-renewed", "127.0.0.1"))
	clk.add(DefaultEvery)
	if got := serial(); got != "mc-renewed" {
		t.Fatalf("after rotation served %q, want the renewed certificate", got)
	}

	// A client trusting another CA is refused by its own verification.
	other, err := ClientTLS(certtest.NewCA(t, "other CA").CertFile, "", false)
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{Transport: &http.Transport{TLSClientConfig: other}}
	if _, err := hc.Get(url); err == nil || !strings.Contains(err.Error(), "certificate signed by unknown authority") {
		t.Fatalf("a client with the wrong CA: %v", err)
	}
	if _, err := ClientTLS(pair.KeyFile, "", false); err == nil {
		t.Fatal("a CA file without certificates was accepted")
	}
}
