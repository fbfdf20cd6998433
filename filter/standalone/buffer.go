package standalone

import (
	"strconv"
	"sync"

	"github.com/envoyproxy/envoy/contrib/golang/common/go/api"
)

// Buffer is the body chunk handed to DecodeData/EncodeData. Like Envoy's it
// is only valid during the phase it was given in; the host reads it back when
// the phase ends.
type Buffer struct {
	mu sync.Mutex
	b  []byte
}

var _ api.BufferInstance = (*Buffer)(nil)

// NewBuffer wraps a copy of p.
func NewBuffer(p []byte) *Buffer { return &Buffer{b: append([]byte(nil), p...)} }

func (b *Buffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.b = append(b.b, p...)
	return len(p), nil
}

func (b *Buffer) WriteString(s string) (int, error) { return b.Write([]byte(s)) }
func (b *Buffer) WriteByte(p byte) error            { _, err := b.Write([]byte{p}); return err }

// The WriteUintN methods append decimal text, as Envoy's httpBuffer does.
func (b *Buffer) WriteUint16(p uint16) error { return b.writeUint(uint64(p)) }
func (b *Buffer) WriteUint32(p uint32) error { return b.writeUint(uint64(p)) }
func (b *Buffer) WriteUint64(p uint64) error { return b.writeUint(p) }
func (b *Buffer) writeUint(p uint64) error {
	_, err := b.WriteString(strconv.FormatUint(p, 10))
	return err
}

func (b *Buffer) Bytes() []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.b) == 0 {
		return nil
	}
	return b.b
}

func (b *Buffer) Drain(offset int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if offset <= 0 {
		return
	}
	offset = min(offset, len(b.b))
	b.b = append([]byte(nil), b.b[offset:]...)
}

func (b *Buffer) Len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.b)
}

func (b *Buffer) Reset()                { b.Drain(b.Len()) }
func (b *Buffer) String() string        { return string(b.Bytes()) }
func (b *Buffer) Append(p []byte) error { _, err := b.Write(p); return err }
func (b *Buffer) AppendString(s string) error {
	_, err := b.WriteString(s)
	return err
}

func (b *Buffer) Prepend(p []byte) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.b = append(append([]byte(nil), p...), b.b...)
	return nil
}

func (b *Buffer) PrependString(s string) error { return b.Prepend([]byte(s)) }

func (b *Buffer) Set(p []byte) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.b = append([]byte(nil), p...)
	return nil
}

func (b *Buffer) SetString(s string) error { return b.Set([]byte(s)) }

// take returns the content and empties the buffer.
func (b *Buffer) take() []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := b.b
	b.b = nil
	return out
}
