package redisstore

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/api"
)

// Pods' registrations live in one hash per cluster, {P:C}:pods, host ->
// "expiryMillis registrationJSON": in the cluster's slot, so the route
// query reads it in the same pipeline as its script (one round trip), and
// with the expiry in the value because Redis 7.0 has no per-field TTL.

// KEYS: pods. ARGV: host value now keyTTL max. The key lives as long as
// the longest registration written to it; past max pods the expired ones
// are dropped.
const registerSrc = `
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[4]) then redis.call('PEXPIRE', KEYS[1], ARGV[4]) end
if redis.call('HLEN', KEYS[1]) > tonumber(ARGV[5]) then
  local all = redis.call('HGETALL', KEYS[1])
  local now = tonumber(ARGV[3])
  for i = 1, #all, 2 do
    local e = tonumber(string.match(all[i + 1], '^(%d+)'))
    if not e or e <= now then redis.call('HDEL', KEYS[1], all[i]) end
  end
end
return 1
`

var registerScript = redis.NewScript(registerSrc)

func (k keys) pods() string { return k.base + ":pods" }

// Register implements store.Registry.
func (s *Store) Register(ctx context.Context, cluster, host string, reg api.PodRegistration, ttl time.Duration) error {
	reg.TTLMS = 0
	js, err := json.Marshal(reg)
	if err != nil {
		return fmt.Errorf("redis register: %w", err)
	}
	now := s.ms()
	val := strconv.FormatInt(now+ttl.Milliseconds(), 10) + " " + string(js)
	_, err = s.run(ctx, "register", registerScript, cluster, []string{s.keys(cluster).pods()},
		host, val, now, ttl.Milliseconds(), api.MaxPodSignals)
	return err
}

// Pods implements store.Registry.
func (s *Store) Pods(ctx context.Context, cluster string) (map[string]api.PodRegistration, error) {
	m, err := s.rdb.HGetAll(ctx, s.keys(cluster).pods()).Result()
	if err != nil {
		return nil, s.wrap("pods", err)
	}
	var out map[string]api.PodRegistration
	now := s.ms()
	for host, v := range m {
		reg, left, err := s.parseRegistration(v, now)
		if err != nil {
			return nil, err
		}
		if left <= 0 {
			continue
		}
		if out == nil {
			out = map[string]api.PodRegistration{}
		}
		reg.TTLMS = left
		out[host] = reg
	}
	return out, nil
}

// regCache keeps registrations already decoded, keyed by their JSON: the
// route query reads every pod's registration each time, and a pod's JSON
// only changes when it restarts (refreshes change the expiry in front of
// it), so decoding them all per query would cost more than the query.
type regCache struct {
	mu sync.Mutex
	m  map[string]api.PodRegistration
}

// maxRegCache bounds the cache; past it, it starts over.
const maxRegCache = 16384

func (c *regCache) decode(js string) (api.PodRegistration, error) {
	c.mu.Lock()
	reg, ok := c.m[js]
	c.mu.Unlock()
	if ok {
		return reg, nil
	}
	if err := json.Unmarshal([]byte(js), &reg); err != nil {
		return api.PodRegistration{}, err
	}
	c.mu.Lock()
	if c.m == nil || len(c.m) >= maxRegCache {
		c.m = map[string]api.PodRegistration{}
	}
	c.m[js] = reg
	c.mu.Unlock()
	return reg, nil
}

// podLabels keeps the live registrations of an HGETALL (host, value, ...)
// for the route answer.
func (s *Store) podLabels(pairs []string, now int64) (map[string]api.PodLabels, error) {
	var out map[string]api.PodLabels
	for i := 0; i+1 < len(pairs); i += 2 {
		host, v := pairs[i], pairs[i+1]
		reg, left, err := s.parseRegistration(v, now)
		if err != nil {
			return nil, err
		}
		if left <= 0 {
			continue
		}
		if out == nil {
			out = make(map[string]api.PodLabels, len(pairs)/2)
		}
		out[host] = reg.PodLabels()
	}
	return out, nil
}

// parseRegistration reads one stored value and the milliseconds it has
// left. The returned registration's maps and slices are shared with the
// cache: callers only read them.
func (s *Store) parseRegistration(v string, now int64) (api.PodRegistration, int64, error) {
	exp, js, ok := strings.Cut(v, " ")
	e, err := strconv.ParseInt(exp, 10, 64)
	if !ok || err != nil {
		return api.PodRegistration{}, 0, fmt.Errorf("redis pods: malformed registration %q", v)
	}
	if e <= now {
		return api.PodRegistration{}, 0, nil
	}
	reg, err := s.regs.decode(js)
	if err != nil {
		return api.PodRegistration{}, 0, fmt.Errorf("redis pods: malformed registration %q: %w", v, err)
	}
	return reg, e - now, nil
}
