package server

import (
	"fmt"
	"sync"
)

// maxChunkSizeClusters bounds the clusters whose chunk size is remembered;
// past it new clusters go unchecked rather than grow memory without bound.
const maxChunkSizeClusters = 10000

// chunkSizes remembers, per routing cluster, the prompt_hash.chunk_size its
// gateways hash with (learned from their cache saves, the last one wins so a
// fleet-wide change takes over), and checks workers' eviction reports
// against it. A worker configured with another size reports hashes that name
// no indexed prefix: its evictions would silently never land and the index
// would keep pointing at prefixes the worker dropped.
type chunkSizes struct {
	mu sync.Mutex
	m  map[string]int
}

func (c *chunkSizes) learn(cluster string, size int) {
	if size <= 0 {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[string]int{}
	}
	if _, ok := c.m[cluster]; ok || len(c.m) < maxChunkSizeClusters {
		c.m[cluster] = size
	}
}

// check returns an error when a report made with size contradicts the
// cluster's gateways. Unknown sizes on either side pass.
func (c *chunkSizes) check(cluster string, size int) error {
	if size <= 0 {
		return nil
	}
	c.mu.Lock()
	want, ok := c.m[cluster]
	c.mu.Unlock()
	if ok && want != size {
		return fmt.Errorf("chunk_size %d differs from the %d the gateways of cluster %q hash with: set the worker's --prompt-hash-chunk-size to %d", size, want, cluster, want)
	}
	return nil
}
