// Package secretfile reads secrets and certificates from files, typically
// mounted from a Kubernetes Secret, and reads them again when they change,
// so a rotated Secret takes effect without a restart.
//
// A change is noticed by stat: the files are looked at again at most every
// Every (default DefaultEvery), and read only when one of them is a
// different file (kubelet swaps a Secret volume's files atomically through
// a symlink) or has another size or modification time. The check is a
// clock comparison on the hot path; the stat runs in one caller at a time
// while the others keep the value they have. Content that cannot be read
// or parsed keeps the last good value and is retried at the next check.
package secretfile

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// DefaultEvery is how often files are looked at when Options leave it zero.
const DefaultEvery = 10 * time.Second

// Options of Watch.
type Options[T any] struct {
	// Every bounds how often the files are looked at; default DefaultEvery.
	Every time.Duration
	// OnChange, if set, learns each new value after the first, with the
	// one it replaces; it runs under the watch's lock.
	OnChange func(old, cur T)
	// OnError, if set, learns why a changed file was not taken.
	OnError func(error)
	// Now is the clock; default time.Now.
	Now func() time.Time
}

// Watched is a value parsed from files, kept current.
type Watched[T any] struct {
	paths []string
	parse func(data [][]byte) (T, error)
	opts  Options[T]

	mu  sync.Mutex // one refresher at a time
	cur atomic.Pointer[state[T]]
}

type state[T any] struct {
	val     T
	infos   []os.FileInfo // nil entries: the file was absent
	checked time.Time
}

// ErrAbsent, wrapped, is the error of a parse function refusing a file
// that does not exist (an absent file's content is nil).
var ErrAbsent = errors.New("file absent")

// Watch reads and parses paths now (a failure is returned) and keeps the
// value current. parse gets each path's content in order; an absent file
// gives nil content, and parse decides whether that is acceptable.
func Watch[T any](paths []string, parse func(data [][]byte) (T, error), opts Options[T]) (*Watched[T], error) {
	if opts.Every <= 0 {
		opts.Every = DefaultEvery
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	w := &Watched[T]{paths: paths, parse: parse, opts: opts}
	infos, data, err := w.read()
	if err != nil {
		return nil, err
	}
	val, err := parse(data)
	if err != nil {
		return nil, err
	}
	w.cur.Store(&state[T]{val: val, infos: infos, checked: opts.Now()})
	return w, nil
}

// Get returns the current value, looking at the files first when the last
// look is more than Every ago.
func (w *Watched[T]) Get() T { return w.fresh(w.opts.Every) }

// Fresh returns the current value, looking at the files first when the
// last look is more than maxAge ago: callers that have reason to think the
// files changed (a token was refused) ask with a short maxAge.
func (w *Watched[T]) Fresh(maxAge time.Duration) T { return w.fresh(maxAge) }

func (w *Watched[T]) fresh(maxAge time.Duration) T {
	s := w.cur.Load()
	if w.opts.Now().Sub(s.checked) < maxAge {
		return s.val
	}
	if !w.mu.TryLock() {
		return s.val // another caller is looking; keep what we have
	}
	defer w.mu.Unlock()
	s = w.cur.Load()
	now := w.opts.Now()
	if now.Sub(s.checked) < maxAge {
		return s.val
	}
	infos, err := w.stat()
	if err == nil && same(infos, s.infos) {
		w.cur.Store(&state[T]{val: s.val, infos: s.infos, checked: now})
		return s.val
	}
	var data [][]byte
	if err == nil {
		infos, data, err = w.read()
	}
	var val T
	if err == nil {
		val, err = w.parse(data)
	}
	if err != nil {
		// Keep the last good value; the next look retries.
		w.cur.Store(&state[T]{val: s.val, infos: s.infos, checked: now})
		if w.opts.OnError != nil {
			w.opts.OnError(err)
		}
		return s.val
	}
	w.cur.Store(&state[T]{val: val, infos: infos, checked: now})
	if w.opts.OnChange != nil {
		w.opts.OnChange(s.val, val)
	}
	return val
}

func (w *Watched[T]) stat() ([]os.FileInfo, error) {
	infos := make([]os.FileInfo, len(w.paths))
	for i, p := range w.paths {
		fi, err := os.Stat(p)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		infos[i] = fi
	}
	return infos, nil
}

func (w *Watched[T]) read() ([]os.FileInfo, [][]byte, error) {
	infos, err := w.stat()
	if err != nil {
		return nil, nil, err
	}
	data := make([][]byte, len(w.paths))
	for i, p := range w.paths {
		if infos[i] == nil {
			continue
		}
		b, err := os.ReadFile(p)
		if errors.Is(err, os.ErrNotExist) {
			infos[i] = nil
			continue
		}
		if err != nil {
			return nil, nil, err
		}
		data[i] = b
	}
	return infos, data, nil
}

func same(a, b []os.FileInfo) bool {
	for i := range a {
		switch {
		case a[i] == nil || b[i] == nil:
			if a[i] != b[i] {
				return false
			}
		case !os.SameFile(a[i], b[i]) || a[i].Size() != b[i].Size() || !a[i].ModTime().Equal(b[i].ModTime()):
			return false
		}
	}
	return true
}

// absent names a missing file in an error.
func absent(path string) error { return fmt.Errorf("%s: %w", path, ErrAbsent) }
