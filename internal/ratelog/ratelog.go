// Package ratelog writes at most one warning per second, counting what it
// held back: with the metadata center down every request fails its query or
// its updates, and one line per second says as much.
package ratelog

import (
	"log/slog"
	"sync/atomic"
	"time"
)

// Logger is safe for concurrent use; its zero value logs to slog.Default().
type Logger struct {
	Log *slog.Logger

	last       atomic.Int64 // unix nanos
	suppressed atomic.Int64
}

// New returns a Logger over log (nil: slog.Default()).
func New(log *slog.Logger) *Logger { return &Logger{Log: log} }

// Warn logs msg unless a line was logged less than a second ago; the next
// line logged says how many were held back (suppressed_since_last).
func (l *Logger) Warn(msg string, args ...any) {
	now := time.Now().UnixNano()
	last := l.last.Load()
	if now-last < int64(time.Second) || !l.last.CompareAndSwap(last, now) {
		l.suppressed.Add(1)
		return
	}
	if n := l.suppressed.Swap(0); n > 0 {
		args = append(args, "suppressed_since_last", n)
	}
	log := l.Log
	if log == nil {
		log = slog.Default()
	}
	log.Warn(msg, args...)
}
