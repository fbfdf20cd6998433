package redisstore

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
)

// Redis Cluster handling.
//
// Every script is idempotent (a lease added twice is counted once, deletes
// of unknown leases are no-ops, saves and refreshes only set expiries), so
// the cluster client may follow MOVED/ASK redirects and retry TRYAGAIN or
// CLUSTERDOWN within the caller's deadline without ever applying an update
// twice in effect. The retry budget is small and the backoff short: a
// failing call still answers 503 within the store timeout and the gateway
// routes without metadata meanwhile.
//
// A killed master never answers MOVED (nothing answers at all), and go-redis
// refreshes its slot map on its own only once a minute, so every failure
// asks for a lazy refresh (one CLUSTER SLOTS, at most one in flight, 200ms
// apart); as soon as a replica has been promoted the next call goes to it.

// clusterStateReload is the backstop refresh of the slot map.
const clusterStateReload = 5 * time.Second

func seedList(addr string) ([]string, error) {
	var seeds []string
	for _, a := range strings.Split(addr, ",") {
		a = strings.TrimSpace(a)
		if a == "" {
			continue
		}
		if _, _, err := net.SplitHostPort(a); err != nil {
			return nil, fmt.Errorf("redisstore: cluster seed %q: want host:port", a)
		}
		seeds = append(seeds, a)
	}
	if len(seeds) == 0 {
		return nil, errors.New("redisstore: Addr lists no cluster seed")
	}
	return seeds, nil
}

func newClusterClient(o Options, seeds []string) *redis.ClusterClient {
	return redis.NewClusterClient(&redis.ClusterOptions{
		Addrs:                      seeds,
		Username:                   o.Username,
		Password:                   o.Password,
		CredentialsProvider:        o.Credentials,
		TLSConfig:                  o.TLS,
		DialTimeout:                o.DialTimeout,
		DialerRetries:              1,
		ReadTimeout:                o.IOTimeout,
		WriteTimeout:               o.IOTimeout,
		PoolTimeout:                o.IOTimeout,
		ContextTimeoutEnabled:      true,
		MaxRedirects:               3,
		MinRetryBackoff:            8 * time.Millisecond,
		MaxRetryBackoff:            64 * time.Millisecond,
		PoolSize:                   o.PoolSize,
		DisableIdentity:            true,
		ClusterStateReloadInterval: clusterStateReload,
		Protocol:                   2, // see New
		MaintNotificationsConfig: &maintnotifications.Config{
			Mode: maintnotifications.ModeDisabled,
		},
	})
}

// slotsMayHaveMoved asks the cluster client to refresh its slot map after
// a failed call (a no-op on a single node). code is the Redis error code,
// "" for network errors.
func (s *Store) slotsMayHaveMoved(code string) {
	if s.cluster == nil {
		return
	}
	switch code {
	case "", "MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN", "READONLY", "MASTERDOWN":
		s.cluster.ReloadState(context.Background())
	}
}

func (s *Store) pingCluster(ctx context.Context) error {
	info, err := s.cluster.ClusterInfo(ctx).Result()
	if err != nil {
		return s.wrap("ping", err)
	}
	if !strings.Contains(info, "cluster_state:ok") {
		s.slotsMayHaveMoved("CLUSTERDOWN")
		return fmt.Errorf("%w: redis cluster state is not ok", store.ErrUnavailable)
	}
	return nil
}
