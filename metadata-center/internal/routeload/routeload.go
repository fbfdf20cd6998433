// Package routeload is the route-query workload shared by the benchmarks
// and cmd/mc-loadgen, so the figures in docs/metadata-center.md all
// measure the same thing.
//
// The default scenario is the issue's: 64 hosts, 64-block prompts. Every
// prompt opens with the same 8-block system prompt, so every host holds
// those blocks and a query starts with all 64 hosts as candidates (the
// expensive case); then each prompt is held whole by 2 hosts and half by 2
// others. Each host has 4 live leases.
package routeload

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// Scenario sizes the index and the load.
type Scenario struct {
	Cluster       string
	Hosts         int
	Blocks        int // hashes per prompt
	SharedBlocks  int // leading blocks common to every prompt
	Prompts       int
	LeasesPerHost int
}

// Default is 64 hosts, 64-block prompts, 64 prompts.
func Default() Scenario {
	return Scenario{Cluster: "outbound|8000||bench.llm.svc.cluster.local",
		Hosts: 64, Blocks: 64, SharedBlocks: 8, Prompts: 64, LeasesPerHost: 4}
}

// Host names host i.
func (s Scenario) Host(i int) string { return fmt.Sprintf("10.0.%d.%d:8000", i/250, i%250+1) }

// Hashes returns prompt p's chained hashes as numbers.
func (s Scenario) Hashes(p int) []prefix.Hash {
	out := make([]prefix.Hash, s.Blocks)
	for i := range out {
		owner := uint64(p + 1)
		if i < s.SharedBlocks {
			owner = 0
		}
		// A cheap bijective mix so hashes look random and never collide.
		x := owner<<32 | uint64(i)
		x ^= x >> 31
		x *= 0x9e3779b97f4a7c15
		x ^= x >> 29
		out[i] = prefix.Hash(x)
	}
	return out
}

// Wire returns prompt p's hashes in wire form.
func (s Scenario) Wire(p int) []string {
	hs := s.Hashes(p)
	out := make([]string, len(hs))
	for i, h := range hs {
		out[i] = h.String()
	}
	return out
}

// Saves lists the cache saves that build the index.
func (s Scenario) Saves() []api.CacheSave {
	var out []api.CacheSave
	q := s.Hosts / 4
	for p := 0; p < s.Prompts; p++ {
		hs := s.Wire(p)
		for k, n := range []int{s.Blocks, s.Blocks, s.Blocks / 2, s.Blocks / 2} {
			host := s.Host((p + k*q) % s.Hosts)
			out = append(out, api.CacheSave{Cluster: s.Cluster, Host: host, Hashes: hs[:n]})
		}
	}
	return out
}

// Adds lists the leases that make every host loaded.
func (s Scenario) Adds() []api.AddRequest {
	var out []api.AddRequest
	for h := 0; h < s.Hosts; h++ {
		for l := 0; l < s.LeasesPerHost; l++ {
			out = append(out, api.AddRequest{Cluster: s.Cluster, Host: s.Host(h),
				RequestID: fmt.Sprintf("bench-%d-%d", h, l), PromptLength: int64(100 * (l + 1))})
		}
	}
	return out
}

// Populate fills a store's leases and index directly.
func (s Scenario) Populate(ctx context.Context, st store.Parts) error {
	for _, a := range s.Adds() {
		if err := st.Leases.AddLease(ctx, a.Cluster, a.Host, a.RequestID, a.PromptLength); err != nil {
			return err
		}
	}
	for _, sv := range s.Saves() {
		hs := make([]prefix.Hash, len(sv.Hashes))
		for i, w := range sv.Hashes {
			h, err := prefix.ParseHash(w)
			if err != nil {
				return err
			}
			hs[i] = h
		}
		if err := st.Index.SaveCacheAs(ctx, sv.Cluster, sv.Host, hs, "", 0, 0); err != nil {
			return err
		}
	}
	return nil
}

// Client talks to a metadata center over HTTP.
type Client struct {
	Base  string // http://host:port
	Token string
	HTTP  *http.Client
}

// NewClient keeps enough idle connections for conc concurrent callers, so
// the load run measures requests, not TCP handshakes.
func NewClient(base, token string, conc int) *Client {
	tr := &http.Transport{MaxIdleConns: conc * 2, MaxIdleConnsPerHost: conc * 2, IdleConnTimeout: time.Minute}
	return &Client{Base: base, Token: token, HTTP: &http.Client{Transport: tr, Timeout: 10 * time.Second}}
}

// Do posts body to path and decodes a 200 answer into out (if not nil).
func (c *Client) Do(ctx context.Context, method, path string, body []byte, out any) error {
	req, err := http.NewRequestWithContext(ctx, method, c.Base+path, bytes.NewReader(body))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	if c.Token != "" {
		req.Header.Set("Authorization", "Bearer "+c.Token)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("%s %s: %d %s", method, path, resp.StatusCode, raw)
	}
	if out != nil {
		return json.Unmarshal(raw, out)
	}
	return nil
}

// Conn is one keep-alive HTTP/1.1 connection driven by hand, as wrk
// does: net/http's client costs as much CPU as the server under test, and
// on a 2-core machine the load generator would measure itself. It reads
// answers with its own small parser for the same reason (net/http's
// ReadResponse, its header map and body reader, were a third of the load
// client's CPU).
type Conn struct {
	addr, token string
	// Accept, when set, is sent as the Accept header.
	Accept    string
	c         net.Conn
	br        *bufio.Reader
	req, body []byte
	mediaType []byte // the last answer's Content-Type
}

// NewConn returns a Conn to base (http://host:port); it dials lazily and
// redials after an error. One goroutine at a time.
func NewConn(base, token string) (*Conn, error) {
	u, err := url.Parse(base)
	if err != nil {
		return nil, err
	}
	return &Conn{addr: u.Host, token: token}, nil
}

// Close closes the connection.
func (c *Conn) Close() {
	if c.c != nil {
		c.c.Close()
		c.c = nil
	}
}

// Post sends body to path and decodes a 200 answer into out (if not nil).
func (c *Conn) Post(path string, body []byte, out any) error {
	raw, err := c.PostRaw(path, body)
	if err == nil && out != nil {
		err = json.Unmarshal(raw, out)
	}
	return err
}

// PostRaw sends body to path and returns a 200 answer's body, valid until
// the next call; any other status is an error.
func (c *Conn) PostRaw(path string, body []byte) ([]byte, error) {
	c.mediaType = c.mediaType[:0]
	if c.c == nil {
		nc, err := net.DialTimeout("tcp", c.addr, 5*time.Second)
		if err != nil {
			return nil, err
		}
		c.c, c.br = nc, bufio.NewReaderSize(nc, 64<<10)
	}
	c.req = append(c.req[:0], "POST "...)
	c.req = append(c.req, path...)
	c.req = append(c.req, " HTTP/1.1\r\nHost: "...)
	c.req = append(c.req, c.addr...)
	c.req = append(c.req, "\r\nContent-Type: application/json\r\n"...)
	if c.token != "" {
		c.req = append(c.req, "Authorization: Bearer "...)
		c.req = append(c.req, c.token...)
		c.req = append(c.req, "\r\n"...)
	}
	if c.Accept != "" {
		c.req = append(c.req, "Accept: "...)
		c.req = append(c.req, c.Accept...)
		c.req = append(c.req, "\r\n"...)
	}
	c.req = append(c.req, "Content-Length: "...)
	c.req = strconv.AppendInt(c.req, int64(len(body)), 10)
	c.req = append(c.req, "\r\n\r\n"...)
	c.req = append(c.req, body...)
	raw, closing, err := c.exchange()
	if err != nil || closing {
		c.c.Close()
		c.c = nil
	}
	return raw, err
}

// MediaType is the Content-Type of the answer PostRaw returned last.
func (c *Conn) MediaType() []byte { return c.mediaType }

// exchange writes the request and reads one answer: the status line, the
// headers that frame it (Content-Length, Transfer-Encoding, Connection),
// its Content-Type and its body. closing says the server will close the
// connection.
func (c *Conn) exchange() (raw []byte, closing bool, err error) {
	_ = c.c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.c.Write(c.req); err != nil {
		return nil, false, err
	}
	line, err := c.br.ReadSlice('\n')
	if err != nil {
		return nil, false, err
	}
	// "HTTP/1.1 200 OK"
	if len(line) < 12 || !bytes.HasPrefix(line, []byte("HTTP/1.")) || line[8] != ' ' {
		return nil, false, fmt.Errorf("malformed status line %q", line)
	}
	status, err := strconv.Atoi(string(line[9:12]))
	if err != nil {
		return nil, false, fmt.Errorf("malformed status line %q", line)
	}
	length, chunked := -1, false
	for {
		if line, err = c.br.ReadSlice('\n'); err != nil {
			return nil, false, err
		}
		line = bytes.TrimRight(line, "\r\n")
		if len(line) == 0 {
			break
		}
		k, v, _ := bytes.Cut(line, []byte(":"))
		v = bytes.TrimSpace(v)
		switch {
		case bytes.EqualFold(k, []byte("Content-Length")):
			if length, err = strconv.Atoi(string(v)); err != nil || length < 0 {
				return nil, false, fmt.Errorf("malformed Content-Length %q", v)
			}
		case bytes.EqualFold(k, []byte("Transfer-Encoding")):
			if !bytes.EqualFold(v, []byte("chunked")) {
				return nil, false, fmt.Errorf("unsupported Transfer-Encoding %q", v)
			}
			chunked = true
		case bytes.EqualFold(k, []byte("Content-Type")):
			c.mediaType = append(c.mediaType[:0], v...)
		case bytes.EqualFold(k, []byte("Connection")):
			closing = bytes.EqualFold(v, []byte("close"))
		}
	}
	switch {
	case chunked:
		if c.body, err = readChunked(c.br, c.body[:0]); err != nil {
			return nil, false, err
		}
	case length >= 0:
		c.body = slices.Grow(c.body[:0], length)[:length]
		if _, err := io.ReadFull(c.br, c.body); err != nil {
			return nil, false, err
		}
	default:
		return nil, false, errors.New("answer has neither Content-Length nor chunks")
	}
	if status != http.StatusOK {
		return nil, closing, fmt.Errorf("%d %s", status, c.body)
	}
	return c.body, closing, nil
}

// readChunked appends a chunked body to b and consumes its trailer.
func readChunked(br *bufio.Reader, b []byte) ([]byte, error) {
	cr := httputil.NewChunkedReader(br)
	for {
		b = slices.Grow(b, 4096)
		n, err := cr.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, err
		}
	}
	for {
		line, err := br.ReadSlice('\n')
		if err != nil {
			return nil, err
		}
		if len(bytes.TrimRight(line, "\r\n")) == 0 {
			return b, nil
		}
	}
}

// PopulateHTTP fills a running metadata center through its API.
func (s Scenario) PopulateHTTP(ctx context.Context, c *Client) error {
	for _, a := range s.Adds() {
		body, _ := json.Marshal(a)
		if err := c.Do(ctx, "POST", api.PathLoadStats, body, nil); err != nil {
			return err
		}
	}
	for _, sv := range s.Saves() {
		body, _ := json.Marshal(sv)
		if err := c.Do(ctx, "POST", api.PathCacheSave, body, nil); err != nil {
			return err
		}
	}
	return nil
}

// Bodies pre-encodes one route query per prompt: the load run measures the
// server, not the client's JSON encoder.
func (s Scenario) Bodies() [][]byte {
	out := make([][]byte, s.Prompts)
	for p := range out {
		out[p], _ = json.Marshal(api.RouteQuery{Cluster: s.Cluster, Hashes: s.Wire(p)})
	}
	return out
}

// Check verifies one answer against the scenario, so a fast but wrong
// server cannot produce a good figure.
func (s Scenario) Check(p int, ans api.RouteAnswer) error {
	if len(ans.Load) != s.Hosts {
		return fmt.Errorf("route answer has load of %d hosts, want %d", len(ans.Load), s.Hosts)
	}
	if len(ans.Cache) == 0 || ans.Cache[0].Length != s.Blocks {
		return fmt.Errorf("route answer for prompt %d lacks a full-length match: %v", p, ans.Cache)
	}
	return nil
}

// checker checks every answer of a run. An answer byte-identical to one
// that passed Check for the same prompt passes too; any other is decoded
// and checked, and if it passes it becomes the prompt's reference. The
// scenario's answers do not change during a run (no lease or save
// expires), so a full decode is paid about once per prompt, and the load
// client's CPU stays small beside the server's it measures.
type checker struct {
	s    Scenario
	refs []atomic.Pointer[[]byte]
}

func (k *checker) check(p int, raw, mediaType []byte) error {
	if ref := k.refs[p].Load(); ref != nil && bytes.Equal(*ref, raw) {
		return nil
	}
	ans, err := api.DecodeRouteAnswer(string(mediaType), raw)
	if err != nil {
		return err
	}
	if err := k.s.Check(p, ans); err != nil {
		return err
	}
	ref := bytes.Clone(raw)
	k.refs[p].Store(&ref)
	return nil
}

// RunConfig bounds a load run by count and by time, whichever comes first.
type RunConfig struct {
	Concurrency int
	Requests    int           // total; 0: no count bound
	Duration    time.Duration // 0: no time bound
	Progress    func(done int64, elapsed time.Duration)
	ProgressGap time.Duration
	// Accept is the route queries' Accept header: api.MediaRouteCompact
	// for the compact answer the filter's client asks for, "" for JSON.
	Accept string
}

// Result of a load run.
type Result struct {
	Requests  int
	Errors    int
	FirstErr  error
	Elapsed   time.Duration
	Latencies []time.Duration // sorted
}

// Throughput is successful requests per second.
func (r Result) Throughput() float64 {
	return float64(r.Requests-r.Errors) / r.Elapsed.Seconds()
}

// Quantile returns the q-quantile (0..1) of the latencies.
func (r Result) Quantile(q float64) time.Duration {
	if len(r.Latencies) == 0 {
		return 0
	}
	i := int(q * float64(len(r.Latencies)-1))
	return r.Latencies[i]
}

// Run sends route queries from cfg.Concurrency closed-loop workers until a
// bound is reached, checking every answer.
func (s Scenario) Run(ctx context.Context, c *Client, cfg RunConfig) (Result, error) {
	if cfg.Concurrency <= 0 {
		return Result{}, errors.New("concurrency must be positive")
	}
	if cfg.Requests <= 0 && cfg.Duration <= 0 {
		return Result{}, errors.New("give a request count or a duration")
	}
	if cfg.Duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, cfg.Duration)
		defer cancel()
	}
	bodies := s.Bodies()
	chk := &checker{s: s, refs: make([]atomic.Pointer[[]byte], len(bodies))}
	var issued, done atomic.Int64
	var mu sync.Mutex
	var res Result
	start := time.Now()
	stopProgress := make(chan struct{})
	if cfg.Progress != nil && cfg.ProgressGap > 0 {
		go func() {
			t := time.NewTicker(cfg.ProgressGap)
			defer t.Stop()
			for {
				select {
				case <-t.C:
					cfg.Progress(done.Load(), time.Since(start))
				case <-stopProgress:
					return
				}
			}
		}()
	}
	u, err := url.Parse(c.Base)
	if err != nil {
		return Result{}, err
	}
	var wg sync.WaitGroup
	for w := 0; w < cfg.Concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cn := &Conn{addr: u.Host, token: c.Token, Accept: cfg.Accept}
			defer cn.Close()
			lat := make([]time.Duration, 0, 1024)
			var errs int
			var firstErr error
			for ctx.Err() == nil {
				n := issued.Add(1)
				if cfg.Requests > 0 && n > int64(cfg.Requests) {
					break
				}
				p := int(n) % len(bodies)
				t0 := time.Now()
				raw, err := cn.PostRaw(api.PathRouteQuery, bodies[p])
				d := time.Since(t0)
				if err != nil && ctx.Err() != nil {
					break // the time bound cut this request short: not a server error
				}
				if err == nil {
					err = chk.check(p, raw, cn.MediaType())
				}
				if err != nil {
					errs++
					if firstErr == nil {
						firstErr = err
					}
				}
				lat = append(lat, d)
				done.Add(1)
			}
			mu.Lock()
			res.Latencies = append(res.Latencies, lat...)
			res.Errors += errs
			if res.FirstErr == nil {
				res.FirstErr = firstErr
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	close(stopProgress)
	res.Elapsed = time.Since(start)
	res.Requests = len(res.Latencies)
	slices.Sort(res.Latencies)
	return res, nil
}

// Loopback reports whether base (http://host:port) names this machine: the
// load tool refuses anything else, so it cannot be pointed at a shared
// deployment by mistake.
func Loopback(base string) error {
	u, err := url.Parse(base)
	if err != nil {
		return err
	}
	host := u.Hostname()
	if host == "localhost" {
		return nil
	}
	ip := net.ParseIP(host)
	if ip == nil || !ip.IsLoopback() {
		return fmt.Errorf("%s is not a loopback address", host)
	}
	return nil
}
