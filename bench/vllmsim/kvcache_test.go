package vllmsim

import (
	"math/rand/v2"
	"testing"

	"github.com/istio-llm-filter/istio-llm-filter/bench/workload"
)

// Idle cached blocks count as free, are found again by their hash until
// reused, and are reused least recently freed first, a sequence's tail
// before its head.
func TestBlockPoolEvictsLeastRecentlyFreedTailFirst(t *testing.T) {
	p := newBlockPool(6, 4)
	seq := func(parent uint64, n int) (ids []int32, hashes []uint64) {
		h := parent
		for i := range n {
			id := p.allocate()
			h = blockHash(h, []uint32{uint32(i), uint32(parent)})
			p.cache(id, h)
			ids, hashes = append(ids, id), append(hashes, h)
		}
		return ids, hashes
	}
	a, ah := seq(1, 3)
	if got := p.usage(); got != 0.5 {
		t.Fatalf("usage with 3 of 6 blocks held = %v, want 0.5", got)
	}
	p.release(a)
	if got := p.usage(); got != 0 {
		t.Fatalf("usage with only idle cached blocks = %v, want 0 (vLLM counts them free)", got)
	}
	if hit := p.longestHit(ah, 3); len(hit) != 3 {
		t.Fatalf("idle cached sequence: hit %d blocks, want 3", len(hit))
	}
	// Three never-used blocks go first, then a's blocks, its last first.
	b, _ := seq(2, 4)
	if hit := p.longestHit(ah, 3); len(hit) != 2 {
		t.Fatalf("after one eviction: hit %d blocks of a, want its head 2 (its tail block evicted first)", len(hit))
	}
	p.release(b)
	hit := p.longestHit(ah, 3)
	for _, id := range hit {
		p.touch(id)
	}
	if p.free != 4 {
		t.Fatalf("free after touching a's 2 cached blocks = %d, want 4", p.free)
	}
	// b is now least recently freed: the next allocations take b's tail.
	id := p.allocate()
	if p.blocks[id].hashed {
		t.Fatal("a reused block kept its hash")
	}
	if n := p.evictableAmong(hit); n != 0 {
		t.Fatalf("touched blocks counted evictable: %d", n)
	}
	p.release(hit)
	if n := p.evictableAmong(hit); n != 2 {
		t.Fatalf("released blocks evictable = %d, want 2", n)
	}
}

// Workload text costs about BytesPerToken bytes a token, and the model's own
// output pieces are one token each.
func TestTokenizeIsBPELike(t *testing.T) {
	text := workload.Text(rand.New(rand.NewPCG(1, 2)), 64<<10)
	ratio := float64(len(text)) / float64(len(Tokenize(text)))
	if ratio < BytesPerToken*0.95 || ratio > BytesPerToken*1.05 {
		t.Fatalf("workload text: %.2f bytes a token, BytesPerToken says %.2f", ratio, BytesPerToken)
	}
	if a, b := Tokenize(text[:1000]), Tokenize(text[:1000]); len(a) != len(b) || a[7] != b[7] {
		t.Fatal("tokenizing the same text twice differed")
	}
	for _, p := range outputPieces {
		if got := Tokenize(p); len(got) != 1 {
			t.Fatalf("output piece %q tokenizes to %d tokens", p, len(got))
		}
	}
	if got := pieces(" request, a\n"); len(got) != 5 || got[0] != " requ" || got[1] != "est" || got[2] != "," || got[3] != " a" {
		t.Fatalf("pieces = %q", got)
	}
}
