package prefix

import (
	"encoding/binary"
	"math/bits"
	"unsafe"
)

// This is the 64-bit half (h1) of MurmurHash3 x64_128, bit-for-bit what
// github.com/spaolacci/murmur3.Sum64 returns (the tests check it against that
// package). It is written out here because the chain hashes le64(prev) ‖ block
// without copying the block behind the 8-byte prefix, and because the
// library's digest keeps a slice of its input, which makes every buffer handed
// to it escape to the heap: two to three allocations per request on the hot path.

const (
	c1 = 0x87c37b91114253d5
	c2 = 0x4cf5ad432745937f
)

func mix(h1, h2, k1, k2 uint64) (uint64, uint64) {
	k1 *= c1
	k1 = bits.RotateLeft64(k1, 31)
	k1 *= c2
	h1 ^= k1
	h1 = bits.RotateLeft64(h1, 27)
	h1 += h2
	h1 = h1*5 + 0x52dce729

	k2 *= c2
	k2 = bits.RotateLeft64(k2, 33)
	k2 *= c1
	h2 ^= k2
	h2 = bits.RotateLeft64(h2, 31)
	h2 += h1
	h2 = h2*5 + 0x38495ab5
	return h1, h2
}

// finish mixes the tail (fewer than 16 bytes) and finalizes. A zero word
// mixes to nothing, so mixing both words of the zero-padded tail is the
// same as the reference's switch on its length.
func finish(h1, h2 uint64, tail []byte, n int) uint64 {
	var k1, k2 uint64
	if len(tail) >= 8 {
		k1 = binary.LittleEndian.Uint64(tail)
		for i := len(tail) - 1; i >= 8; i-- {
			k2 = k2<<8 | uint64(tail[i])
		}
	} else {
		for i := len(tail) - 1; i >= 0; i-- {
			k1 = k1<<8 | uint64(tail[i])
		}
	}
	k1 *= c1
	k1 = bits.RotateLeft64(k1, 31)
	k1 *= c2
	h1 ^= k1
	k2 *= c2
	k2 = bits.RotateLeft64(k2, 33)
	k2 *= c1
	h2 ^= k2

	h1 ^= uint64(n)
	h2 ^= uint64(n)
	h1 += h2
	h2 += h1
	h1 = fmix64(h1)
	h2 = fmix64(h2)
	return h1 + h2
}

func fmix64(k uint64) uint64 {
	k ^= k >> 33
	k *= 0xff51afd7ed558ccd
	k ^= k >> 33
	k *= 0xc4ceb9fe1a85ec53
	k ^= k >> 33
	return k
}

// body mixes every whole 16-byte word of data and returns the rest. Words are
// loaded through unsafe like the reference does (amd64/arm64 allow unaligned
// loads; both are little-endian, as the format requires): with bounds-checked
// loads the chain ran at ~75% of the library's speed instead of ~100%.
func body(h1, h2 uint64, data []byte) (uint64, uint64, []byte) {
	nblocks := len(data) / 16
	if nblocks == 0 {
		return h1, h2, data
	}
	p := unsafe.Pointer(unsafe.SliceData(data))
	for i := 0; i < nblocks; i++ {
		t := (*[2]uint64)(unsafe.Add(p, i*16))
		h1, h2 = mix(h1, h2, t[0], t[1])
	}
	return h1, h2, data[nblocks*16:]
}

// sum64 is murmur3.Sum64(data) (seed 0).
func sum64(data []byte) uint64 {
	h1, h2, tail := body(0, 0, data)
	return finish(h1, h2, tail, len(data))
}

func sum64String(s string) uint64 {
	return sum64(unsafe.Slice(unsafe.StringData(s), len(s)))
}

// sum64Prefixed is murmur3.Sum64(le64(prefix) ‖ data) without building the
// concatenation: the first 16-byte word is prefix plus data[0:8], after which
// data is read at an 8-byte offset. It runs once per 512-byte block, so the
// word loop is written out here rather than called: the calls cost ~5% of
// the chain's throughput.
func sum64Prefixed(prefix uint64, data []byte) uint64 {
	n := 8 + len(data)
	if len(data) < 8 {
		var tail [16]byte
		binary.LittleEndian.PutUint64(tail[:], prefix)
		copy(tail[8:], data)
		return finish(0, 0, tail[:n], n)
	}
	h1, h2 := mix(0, 0, prefix, binary.LittleEndian.Uint64(data))
	data = data[8:]
	words := len(data) / 16
	p := unsafe.Pointer(unsafe.SliceData(data))
	for i := 0; i < words; i++ {
		t := (*[2]uint64)(unsafe.Add(p, i*16))
		h1, h2 = mix(h1, h2, t[0], t[1])
	}
	return finish(h1, h2, data[words*16:], n)
}
