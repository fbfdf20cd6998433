package secretfile

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
)

// ServerTLS is a server's TLS configuration whose certificate and key are
// read from certFile and keyFile and read again when they change: new
// connections get the new certificate, established ones keep theirs.
func ServerTLS(certFile, keyFile string, opts Options[*tls.Certificate]) (*tls.Config, error) {
	if certFile == "" || keyFile == "" {
		return nil, errors.New("TLS needs both a certificate file and a key file")
	}
	w, err := Watch([]string{certFile, keyFile}, func(data [][]byte) (*tls.Certificate, error) {
		if data[0] == nil {
			return nil, absent(certFile)
		}
		if data[1] == nil {
			return nil, absent(keyFile)
		}
		// During a rotation one file may be read before the other is
		// replaced: the pair then does not match and the next look retries.
		c, err := tls.X509KeyPair(data[0], data[1])
		if err != nil {
			return nil, fmt.Errorf("%s, %s: %w", certFile, keyFile, err)
		}
		return &c, nil
	}, opts)
	if err != nil {
		return nil, err
	}
	return &tls.Config{
		MinVersion: tls.VersionTLS12,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return w.Get(), nil
		},
	}, nil
}

// ClientTLS is a client's TLS configuration: the server's certificate is
// verified against the CA certificates in caFile (PEM; empty: the system's
// roots) for the name serverName (empty: the host of the address dialled).
// insecure skips verification altogether, for experiments only. The CA
// file is read once: rotate a CA by publishing a bundle with the old and
// the new CA first (docs/operations.md, "Secrets and TLS").
func ClientTLS(caFile, serverName string, insecure bool) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: serverName, InsecureSkipVerify: insecure}
	if caFile == "" {
		return cfg, nil
	}
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("CA file: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("CA file %s: no PEM certificate in it", caFile)
	}
	cfg.RootCAs = pool
	return cfg, nil
}
