package envoyhost

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
)

// router is Envoy's router filter with the clusters of the route: it takes
// the request the golang filter let through, picks the upstream host and
// proxies. Host selection follows Envoy's override-host load balancing: the
// filter's override host is used when it is a healthy member of the routed
// cluster; otherwise a strict override fails the request with 503 "no
// healthy upstream" (response flag UH) and a non-strict one falls back to the
// cluster's own load balancer (round robin here). Retries never reuse the
// override host.
type router struct {
	h              *Host
	defaultCluster string
	retries        int
	client         *http.Client

	mu       sync.Mutex
	clusters map[string]*cluster
	ups      map[uint64]*upstream
}

type cluster struct {
	hosts   []string
	healthy map[string]bool
	next    int
}

type upstream struct {
	hs       []header
	override string
	strict   bool
	route    string
	body     bytes.Buffer
	trailers []header
	ctx      context.Context
	cancel   context.CancelFunc
}

func newRouter(h *Host, clusters map[string][]string, def string, retries int) *router {
	r := &router{h: h, defaultCluster: def, retries: retries, clusters: map[string]*cluster{}, ups: map[uint64]*upstream{},
		client: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 64, DisableCompression: true, ResponseHeaderTimeout: 5 * time.Minute}}}
	for name, hosts := range clusters {
		r.SetHosts(name, hosts)
	}
	return r
}

// SetHosts replaces a cluster's members (an EDS update); all healthy.
func (r *router) SetHosts(name string, hosts []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := &cluster{hosts: append([]string(nil), hosts...), healthy: map[string]bool{}}
	for _, h := range hosts {
		c.healthy[h] = true
	}
	r.clusters[name] = c
}

// SetHealthy marks a member healthy or not (active health check result).
func (r *router) SetHealthy(name, host string, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if c := r.clusters[name]; c != nil {
		if _, member := c.healthy[host]; member {
			c.healthy[host] = ok
		}
	}
}

func (r *router) handle(f frame) {
	d := &dec{b: f.p}
	r.mu.Lock()
	u := r.ups[f.id]
	switch f.typ {
	case fFwdHeaders:
		end := d.u8() == 1
		u = &upstream{hs: d.headers(), override: d.str(), strict: d.u8() == 1, route: d.str()}
		u.ctx, u.cancel = context.WithCancel(context.Background())
		r.ups[f.id] = u
		r.mu.Unlock()
		if end {
			go r.proxy(f.id, u)
		}
		return
	case fFwdData:
		if u != nil {
			end := d.u8() == 1
			u.body.Write(d.rest())
			r.mu.Unlock()
			if end {
				go r.proxy(f.id, u)
			}
			return
		}
	case fFwdTrailers:
		if u != nil {
			u.trailers = d.headers()
			r.mu.Unlock()
			go r.proxy(f.id, u)
			return
		}
	case fUpstreamCancel:
		if u != nil {
			u.cancel()
			delete(r.ups, f.id)
		}
	}
	r.mu.Unlock()
}

// pick chooses the host of one attempt. Retries skip the hosts already
// tried (Istio's default retry_host_predicate: previous_hosts).
func (r *router) pick(u *upstream, attempt int, tried ...string) (clusterName, host, details string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	// Two routes, as istio/gateway.yaml ships them: with x-llm-cluster
	// present, cluster_header names the cluster (an unknown name is
	// cluster_not_found); without it, the default route's cluster.
	clusterName = r.defaultCluster
	if u.route != "" {
		clusterName = u.route
	}
	c := r.clusters[clusterName]
	if c == nil {
		return clusterName, "", "cluster_not_found"
	}
	if attempt == 1 && u.override != "" {
		if c.healthy[u.override] {
			return clusterName, u.override, ""
		}
		if u.strict {
			return clusterName, "", "no_healthy_upstream"
		}
	}
	for i := 0; i < len(c.hosts); i++ {
		h := c.hosts[c.next%len(c.hosts)]
		c.next++
		if c.healthy[h] && !slices.Contains(tried, h) {
			return clusterName, h, ""
		}
	}
	return clusterName, "", "no_healthy_upstream"
}

func (r *router) conn(id uint64) (uint32, bool) {
	r.h.mu.Lock()
	defer r.h.mu.Unlock()
	s := r.h.streams[id]
	if s == nil {
		return 0, false
	}
	return s.conn, true
}

func (r *router) respFrame(id uint64, typ uint8, build func(e *enc)) {
	conn, ok := r.conn(id)
	if !ok {
		return
	}
	e := &enc{}
	e.u32(conn)
	build(e)
	_ = r.h.send(frame{typ: typ, id: id, p: e.b})
}

// localReply is the router's own reply (Envoy's router sendLocalReply):
// the host runs it through the filter's encoder side.
func (r *router) localReply(id uint64, clusterName string, attempts int, status int, details, body string) {
	r.respFrame(id, fRespHeaders, func(e *enc) {
		e.u8(0)
		e.str("")
		e.str(clusterName)
		e.u8(uint8(attempts))
		e.str(details)
		e.headers([]header{{":status", itoa(status)}})
		e.b = append(e.b, body...)
	})
}

func (r *router) proxy(id uint64, u *upstream) {
	defer func() {
		r.mu.Lock()
		if r.ups[id] == u {
			delete(r.ups, id)
		}
		r.mu.Unlock()
	}()
	var method, path, authority string
	hdr := http.Header{}
	for _, hd := range u.hs {
		switch hd.k {
		case ":method":
			method = hd.v
		case ":path":
			path = hd.v
		case ":authority":
			authority = hd.v
		case ":scheme", "transfer-encoding", "connection", "trailer":
		default:
			hdr.Add(hd.k, hd.v)
		}
	}
	var tried []string
	for attempt := 1; ; attempt++ {
		clusterName, host, details := r.pick(u, attempt, tried...)
		tried = append(tried, host)
		if host == "" {
			body := "no healthy upstream"
			if details == "cluster_not_found" {
				body = ""
			}
			r.localReply(id, clusterName, attempt, http.StatusServiceUnavailable, details, body)
			return
		}
		req, err := http.NewRequestWithContext(u.ctx, method, "http://"+host+path, bytes.NewReader(u.body.Bytes()))
		if err != nil {
			r.localReply(id, clusterName, attempt, http.StatusBadRequest, "invalid_request", err.Error())
			return
		}
		req.Header = hdr.Clone()
		req.Host = authority
		req.ContentLength = int64(u.body.Len())
		if len(u.trailers) > 0 {
			req.Trailer = http.Header{}
			for _, t := range u.trailers {
				req.Trailer.Add(t.k, t.v)
			}
			req.ContentLength = -1
			req.Header.Del("content-length")
		} else if req.ContentLength > 0 {
			req.Header.Set("content-length", itoa(int(req.ContentLength)))
		}
		resp, err := r.client.Do(req)
		if err != nil {
			if u.ctx.Err() != nil {
				return
			}
			if attempt <= r.retries {
				continue
			}
			r.localReply(id, clusterName, attempt, http.StatusServiceUnavailable, "upstream_reset_before_response_started{connection_failure}",
				"upstream connect error or disconnect/reset before headers. reset reason: connection failure")
			return
		}
		r.relay(id, u, resp, host, clusterName, attempt)
		return
	}
}

func (r *router) relay(id uint64, u *upstream, resp *http.Response, host, clusterName string, attempt int) {
	defer resp.Body.Close()
	hs := []header{{":status", itoa(resp.StatusCode)}}
	for k, vs := range resp.Header {
		lk := strings.ToLower(k)
		if lk == "transfer-encoding" || lk == "connection" || lk == "trailer" {
			continue
		}
		for _, v := range vs {
			hs = append(hs, header{lk, v})
		}
	}
	r.respFrame(id, fRespHeaders, func(e *enc) {
		e.u8(0)
		e.str(host)
		e.str(clusterName)
		e.u8(uint8(attempt))
		e.str("")
		e.headers(hs)
	})
	buf := make([]byte, 32<<10)
	for {
		n, err := resp.Body.Read(buf)
		if n > 0 {
			chunk := buf[:n]
			r.respFrame(id, fRespData, func(e *enc) { e.u8(0); e.b = append(e.b, chunk...) })
		}
		if err != nil {
			if err != io.EOF {
				// upstream reset mid-body: Envoy resets the downstream stream
				conn, ok := r.conn(id)
				if ok {
					e := &enc{}
					e.u32(conn)
					_ = r.h.send(frame{typ: fReset, id: id, p: e.b})
				}
				return
			}
			break
		}
	}
	var trailers []header
	for k, vs := range resp.Trailer {
		for _, v := range vs {
			if v != "" {
				trailers = append(trailers, header{strings.ToLower(k), v})
			}
		}
	}
	if len(trailers) > 0 {
		r.respFrame(id, fRespTrailers, func(e *enc) { e.headers(trailers) })
		return
	}
	r.respFrame(id, fRespData, func(e *enc) { e.u8(1) })
}

func itoa(n int) string { return strconv.Itoa(n) }
