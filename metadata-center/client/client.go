// Package client is the one Go client of the metadata center's HTTP API
// (docs/metadata-center.md), used by the gateway's filter and by the workers.
// Gateways make the synchronous route query (load and cache locations in one
// round trip, bounded by the query timeout) and send the lifecycle updates
// through a Dispatcher so they never hold up a request; workers send their
// eviction reports.
package client

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/istio-llm-filter/istio-llm-filter/internal/secretfile"
	"github.com/istio-llm-filter/istio-llm-filter/internal/tracing"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// Default per-call bounds when Options leave them zero.
const (
	DefaultQueryTimeout  = 100 * time.Millisecond
	DefaultUpdateTimeout = 500 * time.Millisecond
)

// maxAnswer bounds what is read from one answer: a route answer lists a
// cluster's hosts, a few KiB even for hundreds of pods.
const maxAnswer = 4 << 20

// Client is a metadata-center client. Safe for concurrent use.
type Client struct {
	base          string
	token         func() string
	tokenFile     *secretfile.Watched[string] // nil without AuthTokenFile
	hc            *http.Client
	queryTimeout  time.Duration
	updateTimeout time.Duration
	noBatch       atomic.Bool // the metadata center has no /v1/batch
}

// Options of a client.
type Options struct {
	Address   string // base URL, http:// or https://
	AuthToken string // bearer token, if the metadata center wants one
	// AuthTokenFile, instead of AuthToken, names a file holding the token
	// (its first line; absent or empty: none), re-read when it changes
	// (internal/secretfile); a 401 makes it be looked at again at once.
	AuthTokenFile string
	// TLS configures https:// addresses (secretfile.ClientTLS); nil: the
	// system's roots. It applies to the transport New makes, so it cannot
	// be combined with HTTPClient.
	TLS           *tls.Config
	QueryTimeout  time.Duration
	UpdateTimeout time.Duration
	// HTTPClient nil means a client over NewTransport; timeouts always
	// come from the options, per call.
	HTTPClient *http.Client
}

// StatusError is a non-2xx answer.
type StatusError struct {
	Status int
	Body   api.Error // zero if the answer was not in the error format
	Op     string
}

func (e *StatusError) Error() string {
	if e.Body.Error.Message != "" {
		return fmt.Sprintf("metadata center %s: %d %s: %s", e.Op, e.Status, e.Body.Error.Type, e.Body.Error.Message)
	}
	return fmt.Sprintf("metadata center %s: status %d", e.Op, e.Status)
}

// NewTransport returns a transport suited to many small calls to one host:
// keep-alive pools big enough for the async workers plus concurrent queries,
// and no proxy from the environment (the metadata center is in-cluster).
func NewTransport() *http.Transport {
	return &http.Transport{
		DialContext:           (&net.Dialer{Timeout: 2 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
		MaxIdleConns:          256,
		MaxIdleConnsPerHost:   256,
		IdleConnTimeout:       90 * time.Second,
		ResponseHeaderTimeout: 10 * time.Second,
		ForceAttemptHTTP2:     false,
	}
}

// New returns a client for o.Address.
func New(o Options) (*Client, error) {
	if o.Address == "" {
		return nil, errors.New("metadata-center client: no address")
	}
	u, err := url.Parse(o.Address)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return nil, fmt.Errorf("metadata-center client: bad address %q (want http://host:port or https://...)", o.Address)
	}
	if o.TLS != nil && u.Scheme != "https" {
		return nil, fmt.Errorf("metadata-center client: TLS is configured but the address %q is not https://", o.Address)
	}
	if o.AuthToken != "" && o.AuthTokenFile != "" {
		return nil, errors.New("metadata-center client: set the auth token or its file, not both")
	}
	hc := o.HTTPClient
	switch {
	case hc == nil:
		tr := NewTransport()
		tr.TLSClientConfig = o.TLS
		hc = &http.Client{Transport: tr}
	case o.TLS != nil:
		return nil, errors.New("metadata-center client: TLS goes into the HTTPClient's transport when one is given")
	}
	c := &Client{
		base:          u.Scheme + "://" + u.Host + trimSlash(u.Path),
		token:         func() string { return o.AuthToken },
		hc:            hc,
		queryTimeout:  o.QueryTimeout,
		updateTimeout: o.UpdateTimeout,
	}
	if o.AuthTokenFile != "" {
		w, err := secretfile.ClientToken(o.AuthTokenFile, secretfile.Options[string]{})
		if err != nil {
			return nil, fmt.Errorf("metadata-center client: auth token file: %w", err)
		}
		c.tokenFile, c.token = w, w.Get
	}
	if c.queryTimeout <= 0 {
		c.queryTimeout = DefaultQueryTimeout
	}
	if c.updateTimeout <= 0 {
		c.updateTimeout = DefaultUpdateTimeout
	}
	return c, nil
}

type traceKey struct{}

// WithTraceID returns ctx carrying a request's trace id: calls made with it
// send it as X-Request-Id, so the metadata center's logs name the request
// that caused them.
func WithTraceID(ctx context.Context, id string) context.Context {
	if id == "" {
		return ctx
	}
	return context.WithValue(ctx, traceKey{}, id)
}

// Permanent reports whether err is an answer that retrying cannot change: a
// 4xx other than 408 and 429 (the request itself is wrong, say a chunk size
// the cluster does not use). Transport errors and 5xx are worth retrying.
func Permanent(err error) bool {
	var se *StatusError
	if !errors.As(err, &se) {
		return false
	}
	return se.Status/100 == 4 && se.Status != http.StatusRequestTimeout && se.Status != http.StatusTooManyRequests
}

func trimSlash(p string) string {
	for len(p) > 0 && p[len(p)-1] == '/' {
		p = p[:len(p)-1]
	}
	return p
}

// QueryTimeout is the bound Route applies.
func (c *Client) QueryTimeout() time.Duration { return c.queryTimeout }

// UpdateTimeout is the per-task bound for updates.
func (c *Client) UpdateTimeout() time.Duration { return c.updateTimeout }

// Route asks for the load and the cache locations of hashes in one round
// trip (POST /v1/route/query), within the query timeout. Hashes beyond
// api.MaxHashes are not sent: the leading ones decide prefix matches.
func (c *Client) Route(ctx context.Context, cluster string, hashes []string) (*api.RouteAnswer, error) {
	ctx, cancel := context.WithTimeout(ctx, c.queryTimeout)
	defer cancel()
	if len(hashes) > api.MaxHashes {
		hashes = hashes[:api.MaxHashes]
	}
	if hashes == nil {
		hashes = []string{} // the API wants the field present
	}
	ctx, span := tracing.Start(ctx, "metadata_center.route_query", trace.WithSpanKind(trace.SpanKindClient),
		trace.WithAttributes(attribute.String("llm.cluster", cluster), attribute.Int("llm.hashes", len(hashes))))
	defer span.End()
	var ans api.RouteAnswer
	if err := c.do(ctx, "route query", http.MethodPost, api.PathRouteQuery, api.RouteQuery{Cluster: cluster, Hashes: hashes}, &ans); err != nil {
		span.SetStatus(codes.Error, err.Error())
		return nil, err
	}
	return &ans, nil
}

// AddRequest is addRequest: POST /v1/load/stats.
func (c *Client) AddRequest(ctx context.Context, r api.AddRequest) error {
	return c.do(ctx, "add request", http.MethodPost, api.PathLoadStats, r, nil)
}

// FirstToken is deletePromptLength: DELETE /v1/load/stats/prompt.
func (c *Client) FirstToken(ctx context.Context, r api.RequestRef) error {
	return c.do(ctx, "first token", http.MethodDelete, api.PathLoadStatsPrompt, r, nil)
}

// DeleteRequest is decreaseRequest: DELETE /v1/load/stats.
func (c *Client) DeleteRequest(ctx context.Context, r api.RequestRef) error {
	return c.do(ctx, "delete request", http.MethodDelete, api.PathLoadStats, r, nil)
}

// SaveCache is saveKVCache: POST /v1/cache/save. Hashes beyond
// api.MaxHashes are not sent.
func (c *Client) SaveCache(ctx context.Context, r api.CacheSave) error {
	if len(r.Hashes) > api.MaxHashes {
		r.Hashes = r.Hashes[:api.MaxHashes]
	}
	return c.do(ctx, "cache save", http.MethodPost, api.PathCacheSave, r, nil)
}

// RetractCache is POST /v1/cache/retract: withdraw the save named
// r.SaveID of these prefixes (its request failed before its first token).
func (c *Client) RetractCache(ctx context.Context, r api.CacheRetract) error {
	if len(r.Hashes) > api.MaxHashes {
		r.Hashes = r.Hashes[:api.MaxHashes]
	}
	return c.do(ctx, "cache retract", http.MethodPost, api.PathCacheRetract, r, nil)
}

// EvictCache is POST /v1/cache/evict: a worker no longer holds these
// prefixes, or (All) anything at all. At most api.MaxHashes per call.
func (c *Client) EvictCache(ctx context.Context, r api.CacheEvict) error {
	if len(r.Hashes) > api.MaxHashes {
		return fmt.Errorf("metadata center cache evict: %d hashes, at most %d per call", len(r.Hashes), api.MaxHashes)
	}
	ctx, cancel := context.WithTimeout(ctx, c.updateTimeout)
	defer cancel()
	return c.do(ctx, "cache evict", http.MethodPost, api.PathCacheEvict, r, nil)
}

// ReportSignals is POST /v1/pods/signals: a pod's report about itself.
func (c *Client) ReportSignals(ctx context.Context, r api.PodReport) error {
	ctx, cancel := context.WithTimeout(ctx, c.updateTimeout)
	defer cancel()
	return c.do(ctx, "pod signals", http.MethodPost, api.PathPodSignals, r, nil)
}

// Pods is GET /v1/pods?cluster=C: the cluster's live pod registrations
// (labels, models, LoRA adapters), within the query timeout.
func (c *Client) Pods(ctx context.Context, cluster string) (map[string]api.PodRegistration, error) {
	ctx, cancel := context.WithTimeout(ctx, c.queryTimeout)
	defer cancel()
	var out map[string]api.PodRegistration
	if err := c.do(ctx, "pods", http.MethodGet, api.PathPods+"?cluster="+url.QueryEscape(cluster), nil, &out); err != nil {
		return nil, err
	}
	return out, nil
}

// AnnouncePods tells the metadata center which pods this gateway routes to
// in a cluster, so that it scrapes their signals (api.PodsAnnouncement).
func (c *Client) AnnouncePods(ctx context.Context, a api.PodsAnnouncement) error {
	return c.do(ctx, "announce pods", http.MethodPost, api.PathPodsDiscovered, a, nil)
}

func (c *Client) do(ctx context.Context, op, method, path string, in, out any) error {
	body, err := json.Marshal(in)
	if err != nil {
		return fmt.Errorf("metadata center %s: encode: %w", op, err)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("metadata center %s: %w", op, err)
	}
	req.Header.Set("Content-Type", "application/json")
	_, route := out.(*api.RouteAnswer)
	if route {
		// The compact form is a third of the bytes and cheaper to decode;
		// a metadata center that predates it answers application/json.
		req.Header.Set("Accept", api.MediaRouteCompact+", application/json")
	} else {
		req.Header.Set("Accept", "application/json")
	}
	if tok := c.token(); tok != "" {
		req.Header.Set("Authorization", "Bearer "+tok)
	}
	if id, ok := ctx.Value(traceKey{}).(string); ok {
		req.Header.Set("X-Request-Id", id)
	}
	tracing.Inject(ctx, req.Header)
	resp, err := c.hc.Do(req)
	if err != nil {
		return fmt.Errorf("metadata center %s: %s%w", op, tlsHint(err), err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswer))
	if err != nil {
		return fmt.Errorf("metadata center %s: read answer: %w", op, err)
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		if resp.StatusCode == http.StatusUnauthorized && c.tokenFile != nil {
			c.tokenFile.Fresh(time.Second) // the Secret may have been rotated
		}
		se := &StatusError{Status: resp.StatusCode, Op: op}
		_ = json.Unmarshal(data, &se.Body)
		return se
	}
	if out == nil {
		return nil
	}
	if route {
		*out.(*api.RouteAnswer), err = api.DecodeRouteAnswer(resp.Header.Get("Content-Type"), data)
	} else {
		err = json.Unmarshal(data, out)
	}
	if err != nil {
		return fmt.Errorf("metadata center %s: bad answer: %w", op, err)
	}
	return nil
}

// tlsHint names what to check when the metadata center's certificate was
// not accepted, before the TLS library's own words.
func tlsHint(err error) string {
	var unknown x509.UnknownAuthorityError
	var host x509.HostnameError
	var invalid x509.CertificateInvalidError
	switch {
	case errors.As(err, &unknown):
		return "TLS: the server's certificate is not signed by a trusted CA (check the CA file): "
	case errors.As(err, &host):
		return "TLS: the server's certificate is not for this name (check the address or the server name): "
	case errors.As(err, &invalid):
		return "TLS: the server's certificate is not valid: "
	}
	return ""
}
