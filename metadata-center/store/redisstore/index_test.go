package redisstore_test

import (
	"strings"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/internal/testutil/redistest"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/redisstore"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/storetest"
)

func TestIndexContract(t *testing.T) {
	srv := redistest.Shared(t)
	storetest.RunIndex(t, func(t *testing.T, cfg storetest.Config) store.Store {
		return newStore(t, srv, redisstore.Options{
			KeyPrefix: srv.Prefix + "-" + strings.ReplaceAll(t.Name(), "/", "-"),
			LeaseTTL:  cfg.LeaseTTL, CacheTTL: cfg.CacheTTL, Now: cfg.Now,
		})
	})
}
