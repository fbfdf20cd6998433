package memstore_test

import (
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/memstore"
	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store/storetest"
)

func TestIndexContract(t *testing.T) {
	storetest.RunIndex(t, func(t *testing.T, cfg storetest.Config) store.Store {
		return memstore.New(memstore.Options{LeaseTTL: cfg.LeaseTTL, CacheTTL: cfg.CacheTTL, Now: cfg.Now})
	})
}
