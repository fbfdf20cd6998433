// Package redisstore is the store.Store on Redis (go-redis v9), for running
// several metadata-center replicas against one shared state.
//
// Every call is one EVALSHA (one round trip; go-redis falls back to EVAL
// after a script-cache flush), and all keys of one cluster share the hash
// tag {prefix:cluster}, so the scripts are Redis Cluster-safe. The key
// layout is documented in docs/metadata-center.md. Redis 7.0 has no
// per-field expiry, so freshness lives in the values (expiry in ms: sorted-
// set scores, or the records of a prefix's holder list) and whole keys
// carry a PEXPIRE as a backstop for abandoned clusters.
//
// With Options.Cluster the same scripts run on a Redis Cluster through
// go-redis's cluster client: every script's keys sit in one slot, so each
// call is still one round trip to the master of that slot. See cluster.go
// for how failovers are handled.
//
// Client timeouts are short and retries off on purpose: when Redis is down
// a call fails within a few hundred milliseconds with store.ErrUnavailable
// (the server answers 503) instead of queueing, and go-redis's pool redials
// in the background so service resumes by itself.
package redisstore

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// Defaults of Options.
const (
	DefaultKeyPrefix     = "llmf"
	DefaultDialTimeout   = 250 * time.Millisecond
	DefaultIOTimeout     = 500 * time.Millisecond
	DefaultTouchInterval = time.Second
)

// registerEvery bounds how often one process re-adds a cluster to the
// registry that Stats walks.
const registerEvery = time.Minute

// Options configure a Store. Zero values pick the defaults.
type Options struct {
	Addr string // host:port of redis-server; with Cluster, a comma-separated seed list
	// Cluster talks to a Redis Cluster (go-redis ClusterClient) whose
	// nodes Addr lists some of; the rest are discovered.
	Cluster  bool
	Username string // ACL user; empty: "default"
	Password string
	// Credentials, when set, is asked for the ACL username and password at
	// every new connection (a rotated password file), instead of Username
	// and Password.
	Credentials func() (username, password string)
	// TLS, when set, is how connections to Redis are encrypted and the
	// server verified (a managed Redis with in-transit encryption).
	TLS *tls.Config
	DB  int

	// KeyPrefix namespaces every key (tests use a private one per test).
	// It must not contain '{' or '}', which would break the hash tags.
	KeyPrefix string

	LeaseTTL      time.Duration // default store.DefaultLeaseTTL
	CacheTTL      time.Duration // default store.DefaultCacheTTL
	TouchInterval time.Duration // hits refresh an entry's TTL at most this often; default 1s, negative: always
	SignalMaxAge  time.Duration // pods' reports older than this are not answered; default store.DefaultSignalMaxAge

	DialTimeout time.Duration // default 250ms
	IOTimeout   time.Duration // read and write timeout; default 500ms
	PoolSize    int           // default go-redis's (10 per CPU)

	Now func() time.Time // default time.Now
}

// Store is the Redis store.Store.
type Store struct {
	rdb                       redis.UniversalClient
	cluster                   *redis.ClusterClient // nil on a single node
	sc                        scripts
	prefix                    string
	leaseTTL, cacheTTL, touch int64 // milliseconds
	signalMaxAge              int64 // milliseconds
	now                       func() time.Time

	regMu      sync.Mutex
	registered map[string]time.Time // cluster -> last registration by this process

	regs   regCache // decoded pod registrations (pods.go)
	routes routePipe
}

var _ store.Store = (*Store)(nil)

// Parts implements store.Store: the store fills every part itself.
func (s *Store) Parts() store.Parts {
	return store.Parts{Leases: s, Index: s, Signals: s, Registry: s, Router: s, Batch: s, Health: s}
}

// New builds a Store. It does not connect: Redis may come up later, and
// Ping tells when it is reachable.
func New(o Options) (*Store, error) {
	if o.Addr == "" {
		return nil, errors.New("redisstore: Addr is required")
	}
	if o.KeyPrefix == "" {
		o.KeyPrefix = DefaultKeyPrefix
	}
	if strings.ContainsAny(o.KeyPrefix, "{}") {
		return nil, fmt.Errorf("redisstore: KeyPrefix %q must not contain '{' or '}'", o.KeyPrefix)
	}
	if o.LeaseTTL <= 0 {
		o.LeaseTTL = store.DefaultLeaseTTL
	}
	if o.CacheTTL <= 0 {
		o.CacheTTL = store.DefaultCacheTTL
	}
	if o.TouchInterval == 0 {
		o.TouchInterval = DefaultTouchInterval
	}
	if o.TouchInterval < 0 {
		o.TouchInterval = 0
	}
	if o.SignalMaxAge <= 0 {
		o.SignalMaxAge = store.DefaultSignalMaxAge
	}
	if o.DialTimeout <= 0 {
		o.DialTimeout = DefaultDialTimeout
	}
	if o.IOTimeout <= 0 {
		o.IOTimeout = DefaultIOTimeout
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	st := &Store{
		sc:           newScripts(),
		prefix:       o.KeyPrefix,
		leaseTTL:     o.LeaseTTL.Milliseconds(),
		cacheTTL:     o.CacheTTL.Milliseconds(),
		touch:        o.TouchInterval.Milliseconds(),
		signalMaxAge: o.SignalMaxAge.Milliseconds(),
		now:          o.Now,
		registered:   make(map[string]time.Time),
	}
	if o.Cluster {
		seeds, err := seedList(o.Addr)
		if err != nil {
			return nil, err
		}
		st.cluster = newClusterClient(o, seeds)
		st.rdb = st.cluster
		return st, nil
	}
	st.rdb = redis.NewClient(&redis.Options{
		Addr:                  o.Addr,
		Username:              o.Username,
		Password:              o.Password,
		CredentialsProvider:   o.Credentials,
		TLSConfig:             o.TLS,
		DB:                    o.DB,
		DialTimeout:           o.DialTimeout,
		DialerRetries:         1,
		ReadTimeout:           o.IOTimeout,
		WriteTimeout:          o.IOTimeout,
		PoolTimeout:           o.IOTimeout,
		ContextTimeoutEnabled: true,
		MaxRetries:            -1, // a retried script could apply twice; callers retry
		PoolSize:              o.PoolSize,
		DisableIdentity:       true,
		// RESP2: RESP3's push-notification check costs an extra read
		// syscall per call, and nothing here uses push messages.
		Protocol: 2,
		MaintNotificationsConfig: &maintnotifications.Config{
			Mode: maintnotifications.ModeDisabled,
		},
	})
	return st, nil
}

// keys names the keys of one cluster; see docs/metadata-center.md.
type keys struct{ base string }

func (s *Store) keys(cluster string) keys { return keys{base: "{" + s.prefix + ":" + cluster + "}"} }

func (k keys) leases() []string {
	return []string{k.base + ":lx", k.base + ":lp", k.base + ":lr", k.base + ":lq"}
}

// holders is the hash of every prefix's holder list, and holderTimes
// scores each prefix with its newest record's expiry (docs/metadata-center.md).
func (k keys) holders() string         { return k.base + ":px" }
func (k keys) holderTimes() string     { return k.base + ":pxt" }
func (k keys) host(host string) string { return k.base + ":e:" + host }
func (k keys) hosts() string           { return k.base + ":hosts" }

// versions names the hash of host's entries' last saves: prefix ->
// "savedMillis saveID" (docs/metadata-center.md, "Versions").
func (k keys) versions(host string) string { return k.base + ":v:" + host }

// evictions names the sorted set of host's evictions of the last
// store.EvictionMemory: prefix (or "*", everything) -> when (Unix ms).
func (k keys) evictions(host string) string { return k.base + ":x:" + host }
func (k keys) signals() string              { return k.base + ":sig" }

func (s *Store) registry() string { return "{" + s.prefix + "}:clusters" }

func member(host, id string) string { return host + "|" + id }

func (s *Store) ms() int64 { return s.now().UnixMilli() }

func (s *Store) wrap(op string, err error) error {
	if err == nil {
		return nil
	}
	var rerr redis.Error
	if errors.As(err, &rerr) {
		// These mean "not now" (loading, failing over, out of memory, a
		// long script), not "bad command".
		code, _, _ := strings.Cut(rerr.Error(), " ")
		switch code {
		case "LOADING", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "BUSY", "OOM", "NOREPLICAS", "MOVED", "ASK":
			s.slotsMayHaveMoved(code)
			return fmt.Errorf("%w: redis %s: %v", store.ErrUnavailable, op, err)
		}
		return fmt.Errorf("redis %s: %w", op, err)
	}
	// Network errors, timeouts, a saturated pool, a closed client.
	s.slotsMayHaveMoved("")
	return fmt.Errorf("%w: redis %s: %v", store.ErrUnavailable, op, err)
}

// run executes a script that writes state for cluster, and, at most once
// a minute per cluster and process, records the cluster in the registry in
// the same pipeline (still one round trip).
func (s *Store) run(ctx context.Context, op string, sc *redis.Script, cluster string, ks []string, args ...any) (*redis.Cmd, error) {
	if s.needsRegister(cluster) {
		pipe := s.rdb.Pipeline()
		pipe.SAdd(ctx, s.registry(), cluster)
		pipe.PExpire(ctx, s.registry(), time.Duration(max(s.leaseTTL, s.cacheTTL))*time.Millisecond)
		cmd := sc.EvalSha(ctx, pipe, ks, args...)
		_, err := pipe.Exec(ctx)
		if err == nil {
			return cmd, nil
		}
		if !redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
			s.forget(cluster)
			return nil, s.wrap(op, err)
		}
	}
	cmd := sc.Run(ctx, s.rdb, ks, args...)
	return cmd, s.wrap(op, cmd.Err())
}

func (s *Store) needsRegister(cluster string) bool {
	now := time.Now()
	s.regMu.Lock()
	defer s.regMu.Unlock()
	if t, ok := s.registered[cluster]; ok && now.Sub(t) < registerEvery {
		return false
	}
	// Bounded: a flood of cluster names cannot grow this without limit.
	if len(s.registered) >= 10000 {
		clear(s.registered)
	}
	s.registered[cluster] = now
	return true
}

func (s *Store) forget(cluster string) {
	s.regMu.Lock()
	delete(s.registered, cluster)
	s.regMu.Unlock()
}

// AddLease implements store.Leases.
func (s *Store) AddLease(ctx context.Context, cluster, host, id string, prompt int64) error {
	now := s.ms()
	_, err := s.run(ctx, "add lease", s.sc.add, cluster, s.keys(cluster).leases(),
		now, now+s.leaseTTL, s.leaseTTL, host, member(host, id), prompt)
	return err
}

// FirstToken implements store.Leases.
func (s *Store) FirstToken(ctx context.Context, cluster, host, id string) error {
	return s.wrap("first token", s.sc.firstToken.Run(ctx, s.rdb, s.keys(cluster).leases(), s.ms(), host, member(host, id)).Err())
}

// DeleteLease implements store.Leases.
func (s *Store) DeleteLease(ctx context.Context, cluster, host, id string) error {
	return s.wrap("delete lease", s.sc.del.Run(ctx, s.rdb, s.keys(cluster).leases(), s.ms(), host, member(host, id)).Err())
}

// LoadStats implements store.Leases.
func (s *Store) LoadStats(ctx context.Context, cluster string) (api.LoadStats, error) {
	res, err := s.sc.load.Run(ctx, s.rdb, s.keys(cluster).leases(), s.ms()).Slice()
	if err != nil {
		return nil, s.wrap("load stats", err)
	}
	if len(res) != 2 {
		return nil, fmt.Errorf("redis load stats: unexpected reply %v", res)
	}
	return parseLoad(res[0], res[1])
}

// pairs walks "key\tvalue\tkey\tvalue..." as the scripts return it
// (hosts never contain a tab).
func pairs(v any, fn func(key string, n int64) error) error {
	flat, ok := v.(string)
	if !ok {
		return fmt.Errorf("unexpected reply %T", v)
	}
	for flat != "" {
		key, rest, ok1 := strings.Cut(flat, "\t")
		num, rest, _ := strings.Cut(rest, "\t")
		n, err := strconv.ParseInt(num, 10, 64)
		if !ok1 || err != nil {
			return fmt.Errorf("malformed reply near %q", key)
		}
		if err := fn(key, n); err != nil {
			return err
		}
		flat = rest
	}
	return nil
}

func parseLoad(reqs, prompts any) (api.LoadStats, error) {
	out := api.LoadStats{}
	err := pairs(reqs, func(host string, n int64) error {
		out[host] = api.EndpointStats{TotalReqs: n}
		return nil
	})
	if err == nil {
		err = pairs(prompts, func(host string, n int64) error {
			if st, ok := out[host]; ok {
				st.PromptLength = n
				out[host] = st
			}
			return nil
		})
	}
	if err != nil {
		return nil, fmt.Errorf("redis load stats: %w", err)
	}
	return out, nil
}

// parseLocations reads a cache query's reply: a holder list whose hosts
// all reached groupLen, then "host\tlength\t..." for the hosts that went
// further, whose entry replaces their group entry.
func parseLocations(group, groupLen, rest any) ([]api.CacheLocation, error) {
	g, ok1 := group.(string)
	// One record per ';' of the group, one pair per two tabs of the rest:
	// sized at once, not grown by doubling through a 64-host group.
	r, _ := rest.(string)
	out := make([]api.CacheLocation, 0, strings.Count(g, ";")+strings.Count(r, "\t")/2+1)
	err := pairs(rest, func(host string, n int64) error {
		out = append(out, api.CacheLocation{Host: host, Length: int(n)})
		return nil
	})
	further := len(out)
	gl, ok2 := groupLen.(int64)
	if err == nil && (!ok1 || !ok2) {
		err = fmt.Errorf("unexpected group %T/%T", group, groupLen)
	}
	if err == nil && g != "" {
		// "minExpiry;host expiry;host expiry..."
		_, recs, _ := strings.Cut(g, ";")
	next:
		for recs != "" {
			var rec string
			rec, recs, _ = strings.Cut(recs, ";")
			host, _, ok := strings.Cut(rec, " ")
			if !ok || host == "" {
				err = fmt.Errorf("malformed holder list near %q", rec)
				break
			}
			for _, l := range out[:further] {
				if l.Host == host {
					continue next
				}
			}
			out = append(out, api.CacheLocation{Host: host, Length: int(gl)})
		}
	}
	if err != nil {
		return nil, fmt.Errorf("redis cache query: %w", err)
	}
	store.SortLocations(out)
	return out, nil
}

// appendHashArgs appends hashes to ARGV as pointers into one
// prefix.Wire slice, which go-redis writes as it writes strings: a
// 64-block query then costs two allocations instead of 128 (each hash's
// string, and its boxing into an interface).
func appendHashArgs(args []any, hashes []prefix.Hash) []any {
	ws := prefix.Wire(hashes)
	for i := range ws {
		args = append(args, &ws[i])
	}
	return args
}

// queryArgs builds KEYS (the given first, then px and pxt) and ARGV
// of the query part.
func (s *Store) queryArgs(k keys, first []string, hashes []prefix.Hash) ([]string, []any) {
	now := s.ms()
	ks := make([]string, 0, len(first)+2)
	ks = append(ks, first...)
	ks = append(ks, k.holders(), k.holderTimes())
	args := make([]any, 0, 5+len(hashes))
	args = append(args, now, now+s.cacheTTL, s.cacheTTL, now+s.cacheTTL-s.touch, k.base)
	args = appendHashArgs(args, hashes)
	return ks, args
}

// QueryCache implements store.Index.
func (s *Store) QueryCache(ctx context.Context, cluster string, hashes []prefix.Hash) ([]api.CacheLocation, error) {
	if len(hashes) == 0 {
		return []api.CacheLocation{}, nil
	}
	k := s.keys(cluster)
	ks, args := s.queryArgs(k, nil, hashes)
	res, err := s.sc.query.Run(ctx, s.rdb, ks, args...).Slice()
	if err != nil {
		return nil, s.wrap("cache query", err)
	}
	if len(res) != 3 {
		return nil, fmt.Errorf("redis cache query: unexpected reply %v", res)
	}
	return parseLocations(res[0], res[1], res[2])
}

// Route implements store.Router.
func (s *Store) Route(ctx context.Context, cluster string, hashes []prefix.Hash) (api.RouteAnswer, error) {
	k := s.keys(cluster)
	ks, args := s.queryArgs(k, k.leases(), hashes)
	// The load aggregates, signals and registrations are read in the
	// script's pipeline, after it: same slot, one round trip.
	res, reads, err := s.route(ctx, ks, args, []string{ks[2], ks[3], k.signals(), k.pods()})
	if err != nil {
		return api.RouteAnswer{}, s.wrap("route query", err)
	}
	if len(res) != 3 || len(reads) != 4 {
		return api.RouteAnswer{}, fmt.Errorf("redis route query: unexpected reply %v", res)
	}
	now := args[0].(int64)
	load, err := loadFromPairs(reads[0], reads[1])
	if err != nil {
		return api.RouteAnswer{}, err
	}
	locs, err := parseLocations(res[0], res[1], res[2])
	if err != nil {
		return api.RouteAnswer{}, err
	}
	sig, err := s.freshSignals(reads[2], now)
	if err != nil {
		return api.RouteAnswer{}, err
	}
	pods, err := s.podLabels(reads[3], now)
	if err != nil {
		return api.RouteAnswer{}, err
	}
	return api.RouteAnswer{Load: load, Cache: locs, Signals: sig, Pods: pods}, nil
}

// loadFromPairs joins the HGETALLs (field, value, ...) of the lr and lq
// aggregates. A host appears in lq only while it is in lr (the lease
// scripts keep it so).
func loadFromPairs(reqs, prompts []string) (api.LoadStats, error) {
	out := make(api.LoadStats, len(reqs)/2)
	for i := 0; i+1 < len(reqs); i += 2 {
		n, err := strconv.ParseInt(reqs[i+1], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("redis load stats: malformed count %q of %s", reqs[i+1], reqs[i])
		}
		out[reqs[i]] = api.EndpointStats{TotalReqs: n}
	}
	for i := 0; i+1 < len(prompts); i += 2 {
		host := prompts[i]
		st, ok := out[host]
		if !ok {
			continue
		}
		var err error
		if st.PromptLength, err = strconv.ParseInt(prompts[i+1], 10, 64); err != nil {
			return nil, fmt.Errorf("redis load stats: malformed prompt sum %q of %s", prompts[i+1], host)
		}
		out[host] = st
	}
	return out, nil
}

// ReportSignals implements store.Signals. The report is stored as
// "waiting running kv_util prefill_tokens draining(0|1) kv_capacity
// max_running reports_evictions(0|1) prefill_queue token_seconds
// attention_seconds step_seconds step_left_seconds held_tokens
// held_step_seconds hold_left_seconds at" (prefill_queue
// "tokens:seconds,…", "-" when empty), stamped with this replica's clock
// last (the signals script reads it there; the shorter reports of earlier
// releases, without the hold, the step left, the costs, reports_evictions,
// the capacities or draining, are read too); the hash expires when
// no pod of the cluster has reported for a minute (or ten max ages).
func (s *Store) ReportSignals(ctx context.Context, cluster, host string, sig api.PodSignals) error {
	now := s.ms()
	rep := strconv.FormatInt(sig.Waiting, 10) + " " + strconv.FormatInt(sig.Running, 10) + " " +
		strconv.FormatFloat(sig.KVCacheUtil, 'g', -1, 64) + " " + strconv.FormatInt(sig.PrefillTokens, 10) + " " +
		flagField(sig.Draining) + strconv.FormatInt(sig.KVCapacity, 10) + " " + strconv.FormatInt(sig.MaxRunning, 10) + " " +
		flagField(sig.ReportsEvictions) + queueField(sig.PrefillQueue) + costField(sig.TokenSeconds) +
		costField(sig.AttentionSeconds) + costField(sig.StepSeconds) + costField(sig.StepLeftSeconds) + strconv.FormatInt(sig.HeldTokens, 10) + " " + costField(sig.HeldStepSeconds) +
		costField(sig.HoldLeftSeconds) + strconv.FormatInt(now, 10)
	keyTTL := max(60_000, 10*s.signalMaxAge)
	err := s.sc.signals.Run(ctx, s.rdb, []string{s.keys(cluster).signals()}, host, rep, keyTTL, now-s.signalMaxAge, api.MaxPodSignals).Err()
	return s.wrap("report signals", err)
}

// Signals implements store.Signals.
func (s *Store) Signals(ctx context.Context, cluster string) (map[string]api.PodSignals, error) {
	now := s.ms()
	pairs, err := hgetall(ctx, s.rdb, s.keys(cluster).signals()).Result()
	if err != nil {
		return nil, s.wrap("signals", err)
	}
	return s.freshSignals(pairs, now)
}

// freshSignals keeps the reports of an HGETALL (host, report, ...) of the
// signals hash that are young enough (nil when none is).
func (s *Store) freshSignals(pairs []string, now int64) (map[string]api.PodSignals, error) {
	var out map[string]api.PodSignals
	for i := 0; i+1 < len(pairs); i += 2 {
		host, rep := pairs[i], pairs[i+1]
		sig, ok, err := s.fresh(rep, now)
		if err != nil {
			return nil, err
		}
		if ok {
			if out == nil {
				out = map[string]api.PodSignals{}
			}
			out[host] = sig
		}
	}
	return out, nil
}

// fresh parses one stored report and says whether it is young enough.
func (s *Store) fresh(rep string, now int64) (api.PodSignals, bool, error) {
	f := strings.Fields(rep)
	var sig api.PodSignals
	if len(f) == 17 {
		var errs [3]error
		sig.HeldTokens, errs[0] = strconv.ParseInt(f[13], 10, 64)
		sig.HeldStepSeconds, errs[1] = strconv.ParseFloat(f[14], 64)
		sig.HoldLeftSeconds, errs[2] = strconv.ParseFloat(f[15], 64)
		if err := errors.Join(errs[:]...); err != nil {
			return api.PodSignals{}, false, fmt.Errorf("redis signals: malformed report %q: %w", rep, err)
		}
		f = append(f[:13], f[16])
	}
	if len(f) == 14 {
		left, err := strconv.ParseFloat(f[12], 64)
		if err != nil {
			return api.PodSignals{}, false, fmt.Errorf("redis signals: malformed report %q: %w", rep, err)
		}
		sig.StepLeftSeconds = left
		f = append(f[:12], f[13])
	}
	if len(f) == 13 {
		var errs [4]error
		sig.PrefillQueue, errs[0] = parseQueue(f[8])
		sig.TokenSeconds, errs[1] = strconv.ParseFloat(f[9], 64)
		sig.AttentionSeconds, errs[2] = strconv.ParseFloat(f[10], 64)
		sig.StepSeconds, errs[3] = strconv.ParseFloat(f[11], 64)
		if err := errors.Join(errs[:]...); err != nil {
			return api.PodSignals{}, false, fmt.Errorf("redis signals: malformed report %q: %w", rep, err)
		}
		f = append(f[:8], f[12])
	}
	if len(f) == 9 {
		if f[7] != "0" && f[7] != "1" {
			return api.PodSignals{}, false, fmt.Errorf("redis signals: malformed report %q", rep)
		}
		sig.ReportsEvictions = f[7] == "1"
		f = append(f[:7], f[8])
	}
	if len(f) == 8 {
		var errs [2]error
		sig.KVCapacity, errs[0] = strconv.ParseInt(f[5], 10, 64)
		sig.MaxRunning, errs[1] = strconv.ParseInt(f[6], 10, 64)
		if err := errors.Join(errs[:]...); err != nil {
			return api.PodSignals{}, false, fmt.Errorf("redis signals: malformed report %q: %w", rep, err)
		}
		f = append(f[:5], f[7])
	}
	switch {
	case len(f) == 6 && (f[4] == "0" || f[4] == "1"):
		sig.Draining = f[4] == "1"
		f = append(f[:4], f[5])
	case len(f) != 5:
		return api.PodSignals{}, false, fmt.Errorf("redis signals: malformed report %q", rep)
	}
	var at int64
	var errs [5]error
	sig.Waiting, errs[0] = strconv.ParseInt(f[0], 10, 64)
	sig.Running, errs[1] = strconv.ParseInt(f[1], 10, 64)
	sig.KVCacheUtil, errs[2] = strconv.ParseFloat(f[2], 64)
	sig.PrefillTokens, errs[3] = strconv.ParseInt(f[3], 10, 64)
	at, errs[4] = strconv.ParseInt(f[4], 10, 64)
	if err := errors.Join(errs[:]...); err != nil {
		return api.PodSignals{}, false, fmt.Errorf("redis signals: malformed report %q: %w", rep, err)
	}
	age := now - at
	if age > s.signalMaxAge {
		return api.PodSignals{}, false, nil
	}
	sig.AgeMS = max(0, age)
	return sig, true, nil
}

// costField is a report's cost field with its separator.
func costField(v float64) string { return strconv.FormatFloat(v, 'g', -1, 64) + " " }

// queueField is a report's prefill queue, "tokens:seconds,…" ("-" when
// empty), with its separator.
func queueField(q []api.Prefill) string {
	if len(q) == 0 {
		return "- "
	}
	var b []byte
	for i, p := range q {
		if i > 0 {
			b = append(b, ',')
		}
		b = strconv.AppendInt(b, p.Tokens, 10)
		b = append(b, ':')
		b = strconv.AppendFloat(b, p.Seconds, 'g', -1, 64)
	}
	return string(b) + " "
}

// parseQueue reads queueField's form.
func parseQueue(f string) ([]api.Prefill, error) {
	if f == "-" {
		return nil, nil
	}
	var q []api.Prefill
	for e := range strings.SplitSeq(f, ",") {
		t, sec, ok := strings.Cut(e, ":")
		if !ok {
			return nil, fmt.Errorf("prefill queue entry %q", e)
		}
		n, err1 := strconv.ParseInt(t, 10, 64)
		v, err2 := strconv.ParseFloat(sec, 64)
		if err := errors.Join(err1, err2); err != nil {
			return nil, err
		}
		q = append(q, api.Prefill{Tokens: n, Seconds: v})
	}
	return q, nil
}

// flagField is a report's flag field (draining, reports_evictions)
// with its separator.
func flagField(on bool) string {
	if on {
		return "1 "
	}
	return "0 "
}

// SaveCacheAs implements store.Index.
func (s *Store) SaveCacheAs(ctx context.Context, cluster, host string, hashes []prefix.Hash, saveID string, at int64, maxEntries int) error {
	if len(hashes) == 0 {
		return nil
	}
	ks, args := s.saveArgs(s.keys(cluster), host, hashes, saveID, false, at, maxEntries)
	_, err := s.run(ctx, "cache save", s.sc.save, cluster, ks, args...)
	return err
}

// RefreshCache implements store.Index: the save script, told to skip the
// prefixes host does not hold, so still one round trip.
func (s *Store) RefreshCache(ctx context.Context, cluster, host string, hashes []prefix.Hash, saveID string) error {
	if len(hashes) == 0 {
		return nil
	}
	ks, args := s.saveArgs(s.keys(cluster), host, hashes, saveID, true, 0, 0)
	_, err := s.run(ctx, "cache refresh", s.sc.save, cluster, ks, args...)
	return err
}

// saveArgs builds the save script's KEYS and ARGV.
func (s *Store) saveArgs(k keys, host string, hashes []prefix.Hash, saveID string, refreshOnly bool, at int64, maxEntries int) ([]string, []any) {
	now := s.ms()
	ks := []string{k.host(host), k.hosts(), k.versions(host), k.holders(), k.holderTimes(), k.evictions(host)}
	args := make([]any, 0, 9+len(hashes))
	flag := "0"
	if refreshOnly {
		flag = "1"
	}
	if at <= 0 || at > now {
		at = now
	}
	args = append(args, now, now+s.cacheTTL, s.cacheTTL, host, saveID, flag, at, store.EvictionMemory.Milliseconds(), maxEntries)
	args = appendHashArgs(args, hashes)
	return ks, args
}

// EvictCacheBefore implements store.Index.
func (s *Store) EvictCacheBefore(ctx context.Context, cluster, host string, hashes []prefix.Hash, before int64) error {
	if len(hashes) == 0 {
		return nil
	}
	ks, args := s.unholdArgs(s.keys(cluster), host, hashes, max(before, 0), store.EvictionMemory.Milliseconds())
	return s.wrap("cache evict", s.sc.evict.Run(ctx, s.rdb, ks, args...).Err())
}

// RetractCache implements store.Index.
func (s *Store) RetractCache(ctx context.Context, cluster, host string, hashes []prefix.Hash, saveID string) error {
	if len(hashes) == 0 || saveID == "" {
		return nil
	}
	ks, args := s.unholdArgs(s.keys(cluster), host, hashes, saveID)
	return s.wrap("cache retract", s.sc.retract.Run(ctx, s.rdb, ks, args...).Err())
}

// unholdArgs builds the KEYS and ARGV of the evict and retract scripts;
// conds are the eviction time and store.EvictionMemory, or the retracted
// save's id.
func (s *Store) unholdArgs(k keys, host string, hashes []prefix.Hash, conds ...any) ([]string, []any) {
	ks := []string{k.host(host), k.hosts(), k.versions(host), k.holders(), k.holderTimes(), k.evictions(host)}
	args := make([]any, 0, 2+len(conds)+len(hashes))
	args = append(args, s.ms(), host)
	args = append(args, conds...)
	args = appendHashArgs(args, hashes)
	return ks, args
}

// EvictHostBefore implements store.Index.
func (s *Store) EvictHostBefore(ctx context.Context, cluster, host string, before int64) error {
	k := s.keys(cluster)
	return s.wrap("cache evict all", s.sc.evictHost.Run(ctx, s.rdb,
		[]string{k.host(host), k.hosts(), k.versions(host), k.holders(), k.holderTimes(), k.evictions(host)},
		s.ms(), host, max(before, 0), store.EvictionMemory.Milliseconds()).Err())
}

// Stats implements store.Health. It costs one round trip per registered
// cluster, which is fine at scrape rate.
func (s *Store) Stats(ctx context.Context) (store.Stats, error) {
	clusters, err := s.rdb.SMembers(ctx, s.registry()).Result()
	if err != nil {
		return store.Stats{}, s.wrap("stats", err)
	}
	now := s.ms()
	var st store.Stats
	for _, c := range clusters {
		k := s.keys(c)
		res, err := s.sc.stats.Run(ctx, s.rdb, []string{k.base + ":lx", k.hosts()}, now, k.base).Int64Slice()
		if err != nil {
			return store.Stats{}, s.wrap("stats", err)
		}
		if len(res) == 2 {
			st.LiveLeases += res[0]
			st.IndexEntries += res[1]
		}
	}
	return st, nil
}

// Ping implements store.Health. On a Redis Cluster it asks one node for
// CLUSTER INFO: the store is ready when the cluster says every slot is
// served, not merely when some node answers.
func (s *Store) Ping(ctx context.Context) error {
	if s.cluster != nil {
		return s.pingCluster(ctx)
	}
	return s.wrap("ping", s.rdb.Ping(ctx).Err())
}

// Close implements store.Store.
func (s *Store) Close() error { return s.rdb.Close() }
