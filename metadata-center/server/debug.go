package server

import (
	"net/http"

	"github.com/gin-gonic/gin"

	"github.com/istio-llm-filter/istio-llm-filter/metadata-center/store"
)

// cacheIndex answers api.PathDebugCacheIndex. Stores without a listing
// answer 501: the check is optional, the API is not.
func (s *Server) cacheIndex(c *gin.Context) {
	cluster, err := validCluster(c.Query("cluster"))
	if err != nil {
		s.badRequest(c, err)
		return
	}
	lister, ok := s.st.(store.IndexLister)
	if !ok {
		s.fail(c, http.StatusNotImplemented, "not_implemented", "this store cannot list its cache index")
		return
	}
	ctx, cancel := s.storeCtx(c)
	defer cancel()
	idx, err := lister.CacheIndex(ctx, cluster)
	if err != nil {
		s.storeFailed(c, "cache index", err)
		return
	}
	out := make(map[string][]string, len(idx))
	for host, hs := range idx {
		strs := make([]string, len(hs))
		for i, h := range hs {
			strs[i] = h.String()
		}
		out[host] = strs
	}
	s.ok(c, out)
}
