package envoyhost

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// Frame types of the pipe between the driver and the C host
// (envoyhost/chost/host.c keeps the same numbers).
const (
	fCfgPush       = 1
	fRouteCfg      = 2
	fReqHeaders    = 3
	fReqData       = 4
	fReqTrailers   = 5
	fRespHeaders   = 6
	fRespData      = 7
	fRespTrailers  = 8
	fReset         = 9
	fMetrics       = 10
	fShutdown      = 11
	fCfgDrop       = 12
	fGC            = 13
	fLocalReplyCfg = 14

	fFwdHeaders     = 51
	fFwdData        = 52
	fFwdTrailers    = 53
	fClientHeaders  = 54
	fClientData     = 55
	fClientTrailers = 56
	fStreamEnd      = 57
	fUpstreamCancel = 58
	fCfgPushed      = 101
	fRouteSet       = 102
	fCfgDestroyed   = 103
	fMetricsOut     = 110
	fBye            = 111
	fLocalReplySet  = 113
	fGCDone         = 112
)

// frame is one message: [u32 len][u8 type][u64 id][payload].
type frame struct {
	typ uint8
	id  uint64
	p   []byte
}

// header is one field in order; keys are lower case, pseudo-headers first.
type header struct{ k, v string }

type enc struct{ b []byte }

func (e *enc) u8(v uint8)   { e.b = append(e.b, v) }
func (e *enc) u32(v uint32) { e.b = binary.LittleEndian.AppendUint32(e.b, v) }
func (e *enc) str(s string) {
	e.u32(uint32(len(s)))
	e.b = append(e.b, s...)
}
func (e *enc) headers(hs []header) {
	e.u32(uint32(len(hs)))
	for _, h := range hs {
		e.str(h.k)
		e.str(h.v)
	}
}

type dec struct {
	b   []byte
	err error
}

func (d *dec) take(n int) []byte {
	if d.err != nil || len(d.b) < n {
		d.err = errors.New("envoyhost: short frame")
		return nil
	}
	v := d.b[:n]
	d.b = d.b[n:]
	return v
}
func (d *dec) u8() uint8 {
	if v := d.take(1); v != nil {
		return v[0]
	}
	return 0
}
func (d *dec) u32() uint32 {
	if v := d.take(4); v != nil {
		return binary.LittleEndian.Uint32(v)
	}
	return 0
}
func (d *dec) u64() uint64 {
	if v := d.take(8); v != nil {
		return binary.LittleEndian.Uint64(v)
	}
	return 0
}
func (d *dec) str() string { return string(d.take(int(d.u32()))) }
func (d *dec) headers() []header {
	n := int(d.u32())
	hs := make([]header, 0, n)
	for i := 0; i < n && d.err == nil; i++ {
		k := d.str()
		hs = append(hs, header{k, d.str()})
	}
	return hs
}
func (d *dec) rest() []byte { v := d.b; d.b = nil; return v }

func writeFrame(w io.Writer, f frame) error {
	b := make([]byte, 0, 13+len(f.p))
	b = binary.LittleEndian.AppendUint32(b, uint32(9+len(f.p)))
	b = append(b, f.typ)
	b = binary.LittleEndian.AppendUint64(b, f.id)
	b = append(b, f.p...)
	_, err := w.Write(b)
	return err
}

func readFrame(r *bufio.Reader) (frame, error) {
	var hdr [4]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return frame{}, err
	}
	n := binary.LittleEndian.Uint32(hdr[:])
	if n < 9 || n > 1<<30 {
		return frame{}, fmt.Errorf("envoyhost: bad frame length %d", n)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return frame{}, err
	}
	return frame{typ: b[0], id: binary.LittleEndian.Uint64(b[1:9]), p: b[9:]}, nil
}
