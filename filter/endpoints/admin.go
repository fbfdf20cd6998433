package endpoints

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of the envoy_admin section (docs/configuration.md).
const (
	DefaultAdminAddress = "http://127.0.0.1:15000"
	DefaultAdminRefresh = time.Second
)

// maxAdminBody bounds what one poll reads: a mesh with thousands of clusters
// produces megabytes of /clusters JSON, but never hundreds.
const maxAdminBody = 64 << 20

// adminClusters mirrors the parts of envoy.admin.v3.Clusters that we read.
// Envoy renders the admin protos with their original (snake_case) field names.
type adminClusters struct {
	ClusterStatuses []struct {
		Name         string `json:"name"`
		HostStatuses []struct {
			Address struct {
				SocketAddress *struct {
					Address   string `json:"address"`
					PortValue uint32 `json:"port_value"`
				} `json:"socket_address"`
			} `json:"address"`
			HealthStatus adminHealth `json:"health_status"`
		} `json:"host_statuses"`
	} `json:"cluster_statuses"`
}

type adminHealth struct {
	FailedActiveHealthCheck    bool   `json:"failed_active_health_check"`
	FailedOutlierCheck         bool   `json:"failed_outlier_check"`
	FailedActiveDegradedCheck  bool   `json:"failed_active_degraded_check"`
	PendingDynamicRemoval      bool   `json:"pending_dynamic_removal"`
	PendingActiveHC            bool   `json:"pending_active_hc"`
	ExcludedViaImmediateHCFail bool   `json:"excluded_via_immediate_hc_fail"`
	ActiveHCTimeout            bool   `json:"active_hc_timeout"`
	EDSHealthStatus            string `json:"eds_health_status"`
}

// routable follows Envoy's own host selection: a host is used unless a health
// check, outlier detection, EDS or an immediate-fail signal took it out. A
// degraded host still serves in Envoy (at lower priority), so it stays here;
// a host awaiting its first active check is not yet routable.
func (h adminHealth) routable() bool {
	if h.FailedActiveHealthCheck || h.FailedOutlierCheck || h.PendingDynamicRemoval ||
		h.PendingActiveHC || h.ExcludedViaImmediateHCFail || h.ActiveHCTimeout {
		return false
	}
	switch strings.ToUpper(h.EDSHealthStatus) {
	case "", "UNKNOWN", "HEALTHY", "DEGRADED":
		return true
	default: // UNHEALTHY, DRAINING, TIMEOUT
		return false
	}
}

// ParseAdminClusters turns the body of Envoy's GET /clusters?format=json into
// cluster -> routable "ip:port" endpoints. Hosts that are not IP sockets (pipes,
// internal addresses) cannot be targets of SetUpstreamOverrideHost and are skipped.
func ParseAdminClusters(body []byte) (map[string][]Endpoint, error) {
	var doc adminClusters
	if err := json.Unmarshal(body, &doc); err != nil {
		return nil, fmt.Errorf("endpoints: envoy admin /clusters: %w", err)
	}
	out := make(map[string][]Endpoint, len(doc.ClusterStatuses))
	for _, c := range doc.ClusterStatuses {
		eps := []Endpoint{}
		seen := map[string]bool{}
		for _, h := range c.HostStatuses {
			sa := h.Address.SocketAddress
			if sa == nil || !h.HealthStatus.routable() {
				continue
			}
			addr, err := NormalizeAddress(fmt.Sprintf("%s:%d", bracket(sa.Address), sa.PortValue))
			if err != nil || seen[addr] {
				continue
			}
			seen[addr] = true
			eps = append(eps, Endpoint{Address: addr})
		}
		out[c.Name] = eps
	}
	return out, nil
}

func bracket(host string) string {
	if strings.Contains(host, ":") && !strings.HasPrefix(host, "[") {
		return "[" + host + "]"
	}
	return host
}

// AdminOptions configure an AdminPoller.
type AdminOptions struct {
	Address string        // base URL of Envoy's admin listener; DefaultAdminAddress if empty
	Refresh time.Duration // poll period; DefaultAdminRefresh if zero
	Client  *http.Client  // nil: a client with a timeout of one refresh period
	Logger  *slog.Logger
}

// AdminPoller keeps a snapshot of Envoy's clusters, refreshed in the
// background. Endpoints never blocks: it reads the last snapshot. A failed
// poll keeps the previous snapshot, because routing on slightly stale pods
// beats routing on none.
type AdminPoller struct {
	url     string
	refresh time.Duration
	client  *http.Client
	log     *slog.Logger

	snap   atomic.Pointer[map[string][]Endpoint]
	polls  atomic.Uint64
	errors atomic.Uint64

	cancel context.CancelFunc
	done   chan struct{}
}

// NewAdminPoller validates the options and starts polling. The first poll is
// asynchronous too: Envoy parses filter configs on its main thread, which is
// also the thread serving the admin API, so a synchronous first poll from
// Parse would wait on itself.
func NewAdminPoller(opts AdminOptions) (*AdminPoller, error) {
	addr := opts.Address
	if addr == "" {
		addr = DefaultAdminAddress
	}
	if !strings.Contains(addr, "://") {
		addr = "http://" + addr
	}
	u, err := url.Parse(addr)
	if err != nil || u.Host == "" || (u.Scheme != "http" && u.Scheme != "https") {
		return nil, fmt.Errorf("endpoints: envoy_admin address %q is not an http(s) URL", opts.Address)
	}
	u.Path = strings.TrimSuffix(u.Path, "/") + "/clusters"
	u.RawQuery = "format=json"
	refresh := opts.Refresh
	if refresh == 0 {
		refresh = DefaultAdminRefresh
	}
	if refresh < 0 {
		return nil, fmt.Errorf("endpoints: envoy_admin refresh %v is negative", refresh)
	}
	client := opts.Client
	if client == nil {
		client = &http.Client{Timeout: max(refresh, 200*time.Millisecond)}
	}
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &AdminPoller{url: u.String(), refresh: refresh, client: client, log: log,
		cancel: cancel, done: make(chan struct{})}
	go p.run(ctx)
	return p, nil
}

func (p *AdminPoller) run(ctx context.Context) {
	defer close(p.done)
	// Inside Envoy a panic here would abort the proxy: log it and stop
	// polling (the last snapshot stays).
	defer func() {
		if e := recover(); e != nil {
			p.log.Error("endpoints: panic in the admin poller; polling stopped", "panic", e)
		}
	}()
	t := time.NewTicker(p.refresh)
	defer t.Stop()
	failing := false
	for {
		if err := p.PollOnce(ctx); err != nil {
			if ctx.Err() != nil {
				return
			}
			// Log transitions only: a missing admin would otherwise log every second.
			if !failing {
				p.log.Warn("envoy admin poll failed; keeping the last endpoints", "url", p.url, "err", err)
			}
			failing = true
		} else if failing {
			p.log.Info("envoy admin poll recovered", "url", p.url)
			failing = false
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// PollOnce fetches and installs one snapshot.
func (p *AdminPoller) PollOnce(ctx context.Context) error {
	p.polls.Add(1)
	err := p.poll(ctx)
	if err != nil {
		p.errors.Add(1)
	}
	return err
}

func (p *AdminPoller) poll(ctx context.Context) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, p.url, nil)
	if err != nil {
		return err
	}
	resp, err := p.client.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxAdminBody+1))
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("endpoints: envoy admin answered %s", resp.Status)
	}
	if len(body) > maxAdminBody {
		return fmt.Errorf("endpoints: envoy admin /clusters is over %d bytes", maxAdminBody)
	}
	m, err := ParseAdminClusters(body)
	if err != nil {
		return err
	}
	p.snap.Store(&m)
	return nil
}

// Endpoints returns the routable endpoints of the last successful poll.
func (p *AdminPoller) Endpoints(cluster string) []Endpoint {
	m := p.snap.Load()
	if m == nil {
		return nil
	}
	eps := (*m)[cluster]
	out := make([]Endpoint, len(eps))
	copy(out, eps)
	return out
}

// AppendEndpoints implements Appender.
func (p *AdminPoller) AppendEndpoints(dst []Endpoint, cluster string) []Endpoint {
	m := p.snap.Load()
	if m == nil {
		return dst
	}
	return append(dst, (*m)[cluster]...)
}

// Ready reports whether at least one poll succeeded.
func (p *AdminPoller) Ready() bool { return p.snap.Load() != nil }

// Stats returns the number of polls and of failed polls so far.
func (p *AdminPoller) Stats() (polls, failures uint64) { return p.polls.Load(), p.errors.Load() }

// Close stops polling and waits for the poller goroutine to exit.
func (p *AdminPoller) Close() {
	p.cancel()
	<-p.done
}

// Registry shares one AdminPoller per (address, refresh) among every config
// that asks for it. Envoy parses a new config on each xDS push, and each of
// them would otherwise start its own poller against the same admin port. The
// process owns one Registry (the .so's main package, the gateway's main).
type Registry struct {
	mu      sync.Mutex
	pollers map[registryKey]*sharedPoller
	log     *slog.Logger
}

type registryKey struct {
	address string
	refresh time.Duration
}

type sharedPoller struct {
	p    *AdminPoller
	refs int
}

// NewRegistry returns an empty registry; logger may be nil.
func NewRegistry(logger *slog.Logger) *Registry {
	return &Registry{pollers: map[registryKey]*sharedPoller{}, log: logger}
}

// Acquire returns the shared poller for the address and refresh, starting it
// on first use. release must be called exactly once (a config's Destroy); the
// poller stops when its last user releases it.
func (r *Registry) Acquire(address string, refresh time.Duration) (src *AdminPoller, release func(), err error) {
	if address == "" {
		address = DefaultAdminAddress
	}
	if refresh == 0 {
		refresh = DefaultAdminRefresh
	}
	k := registryKey{address, refresh}
	r.mu.Lock()
	defer r.mu.Unlock()
	sp := r.pollers[k]
	if sp == nil {
		p, err := NewAdminPoller(AdminOptions{Address: address, Refresh: refresh, Logger: r.log})
		if err != nil {
			return nil, nil, err
		}
		sp = &sharedPoller{p: p}
		r.pollers[k] = sp
	}
	sp.refs++
	var once sync.Once
	return sp.p, func() { once.Do(func() { r.release(k, sp) }) }, nil
}

func (r *Registry) release(k registryKey, sp *sharedPoller) {
	r.mu.Lock()
	sp.refs--
	last := sp.refs == 0
	if last {
		delete(r.pollers, k)
	}
	r.mu.Unlock()
	if last {
		sp.p.Close()
	}
}

// Len is the number of running pollers.
func (r *Registry) Len() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.pollers)
}
