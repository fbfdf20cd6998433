package server

import (
	"github.com/gin-gonic/gin"
)

// cacheIndex answers api.PathDebugCacheIndex.
func (s *Server) cacheIndex(c *gin.Context) {
	cluster, err := validCluster(c.Query("cluster"))
	if err != nil {
		s.badRequest(c, err)
		return
	}
	ctx, cancel := s.storeCtx(c)
	defer cancel()
	idx, err := s.st.Index.CacheIndex(ctx, cluster)
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
