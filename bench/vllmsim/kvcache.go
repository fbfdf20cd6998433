package vllmsim

import (
	"encoding/binary"
	"hash/fnv"
)

// blockPool is vLLM's KV-cache block pool with automatic prefix caching, as
// its design document describes it (docs.vllm.ai/en/latest/design/prefix_caching/,
// vllm/v1/core/block_pool.py and kv_cache_utils.py):
//
//   - the cache is numBlocks blocks of blockSize tokens;
//   - a full block is identified by a chained hash: hash(parent block's hash,
//     the block's token ids), so equal hashes mean equal prefixes;
//   - a block whose reference count drops to zero stays cached (its hash
//     still finds it) but joins the free queue: it counts as free and is
//     reused, least recently freed first, when a new block is needed — only
//     then is its hash evicted;
//   - a request's blocks are freed last block first, so the tail of a
//     sequence is evicted before its (more widely shared) head;
//   - a prefix hit takes a cached block out of the free queue and raises its
//     reference count ("touch").
type blockPool struct {
	blockSize int
	blocks    []kvBlock
	// The free queue, a doubly linked list through kvBlock.prev/next: head
	// is evicted first.
	head, tail int32
	free       int
	cached     map[uint64]int32 // block hash → block holding it
}

type kvBlock struct {
	hash       uint64
	hashed     bool
	ref        int32
	prev, next int32
	inFree     bool
}

const none = -1

func newBlockPool(numBlocks, blockSize int) *blockPool {
	p := &blockPool{blockSize: blockSize, blocks: make([]kvBlock, numBlocks), head: none, tail: none,
		cached: make(map[uint64]int32)}
	for i := range p.blocks {
		p.blocks[i].prev, p.blocks[i].next = none, none
		p.pushFree(int32(i))
	}
	return p
}

// usage is vllm:kv_cache_usage_perc: the share of blocks not free, where
// idle cached blocks count as free (BlockPool.get_usage).
func (p *blockPool) usage() float64 {
	if len(p.blocks) == 0 {
		return 0
	}
	return 1 - float64(p.free)/float64(len(p.blocks))
}

func (p *blockPool) pushFree(id int32) {
	b := &p.blocks[id]
	b.inFree, b.prev, b.next = true, p.tail, none
	if p.tail != none {
		p.blocks[p.tail].next = id
	} else {
		p.head = id
	}
	p.tail = id
	p.free++
}

func (p *blockPool) removeFree(id int32) {
	b := &p.blocks[id]
	if b.prev != none {
		p.blocks[b.prev].next = b.next
	} else {
		p.head = b.next
	}
	if b.next != none {
		p.blocks[b.next].prev = b.prev
	} else {
		p.tail = b.prev
	}
	b.inFree, b.prev, b.next = false, none, none
	p.free--
}

// allocate takes the free queue's head for a new block, evicting the cached
// prefix it held. The caller has checked p.free.
func (p *blockPool) allocate() int32 {
	id := p.head
	p.removeFree(id)
	b := &p.blocks[id]
	if b.hashed {
		if p.cached[b.hash] == id {
			delete(p.cached, b.hash)
		}
		b.hashed = false
	}
	b.ref = 1
	return id
}

// touch takes a reference on a cached block found by a prefix hit.
func (p *blockPool) touch(id int32) {
	b := &p.blocks[id]
	if b.ref == 0 && b.inFree {
		p.removeFree(id)
	}
	b.ref++
}

// release drops a request's references, last block first.
func (p *blockPool) release(ids []int32) {
	for i := len(ids) - 1; i >= 0; i-- {
		b := &p.blocks[ids[i]]
		b.ref--
		if b.ref == 0 {
			p.pushFree(ids[i])
		}
	}
}

// longestHit returns the cached blocks holding the longest prefix of
// hashes, at most limit blocks.
func (p *blockPool) longestHit(hashes []uint64, limit int) []int32 {
	var hit []int32
	for i := 0; i < len(hashes) && i < limit; i++ {
		id, ok := p.cached[hashes[i]]
		if !ok {
			break
		}
		hit = append(hit, id)
	}
	return hit
}

// evictableAmong counts the blocks of ids that sit in the free queue: a
// prefix hit on them uses up free room.
func (p *blockPool) evictableAmong(ids []int32) int {
	n := 0
	for _, id := range ids {
		if p.blocks[id].ref == 0 {
			n++
		}
	}
	return n
}

// cache records a request's block id, now full, under hash (the first block
// to hold a hash keeps it, as vLLM keeps the first copy).
func (p *blockPool) cache(id int32, hash uint64) {
	if _, dup := p.cached[hash]; dup {
		return
	}
	b := &p.blocks[id]
	b.hash, b.hashed = hash, true
	p.cached[hash] = id
}

// blockHash chains a block's token ids onto its parent's hash.
func blockHash(parent uint64, tokens []uint32) uint64 {
	h := fnv.New64a()
	var buf [8]byte
	binary.LittleEndian.PutUint64(buf[:], parent)
	h.Write(buf[:])
	for _, t := range tokens {
		binary.LittleEndian.PutUint32(buf[:4], t)
		h.Write(buf[:4])
	}
	return h.Sum64()
}
