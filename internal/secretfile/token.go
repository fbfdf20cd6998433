package secretfile

import (
	"crypto/subtle"
	"fmt"
	"strings"
	"sync"
	"time"
)

// tokenLines reads a token file: one token per line, surrounding blanks and
// empty lines ignored. An absent file holds no token.
func tokenLines(path string, data []byte) ([]string, error) {
	var out []string
	for _, l := range strings.Split(string(data), "\n") {
		l = strings.TrimSpace(l)
		if l == "" {
			continue
		}
		if strings.ContainsFunc(l, func(r rune) bool { return r < 0x21 || r == 0x7f }) {
			return nil, fmt.Errorf("%s: a token must not contain blanks or control characters", path)
		}
		out = append(out, l)
	}
	return out, nil
}

// ClientToken is the bearer token a client sends, read from path: the
// file's first token (a file listing the new token before the old one
// serves clients and the metadata center alike during a rotation,
// docs/operations.md). An absent or empty file means no token.
func ClientToken(path string, opts Options[string]) (*Watched[string], error) {
	return Watch([]string{path}, func(data [][]byte) (string, error) {
		toks, err := tokenLines(path, data[0])
		if err != nil || len(toks) == 0 {
			return "", err
		}
		return toks[0], nil
	}, opts)
}

// Tokens are the bearer tokens a server accepts, read from a file listing
// them one per line. After the file changes, the tokens it held before
// stay accepted for a grace period, so clients that read the same Secret
// a little later than the server are not refused meanwhile. An absent or
// empty file accepts every caller (authentication off), as an empty
// --auth-token does.
type Tokens struct {
	w     *Watched[[]string]
	grace time.Duration
	now   func() time.Time

	mu        sync.Mutex
	prev      []string
	prevUntil time.Time
}

// refusedRecheck bounds how often a refused token makes the file be looked
// at again (a client may have read a newer Secret than this server).
const refusedRecheck = time.Second

// ServerTokens watches path for the tokens a server accepts.
func ServerTokens(path string, grace time.Duration, opts Options[[]string]) (*Tokens, error) {
	if opts.Now == nil {
		opts.Now = time.Now
	}
	t := &Tokens{grace: grace, now: opts.Now}
	onChange := opts.OnChange
	opts.OnChange = func(old, cur []string) {
		t.mu.Lock()
		t.prev, t.prevUntil = old, t.now().Add(t.grace)
		t.mu.Unlock()
		if onChange != nil {
			onChange(old, cur)
		}
	}
	w, err := Watch([]string{path}, func(data [][]byte) ([]string, error) { return tokenLines(path, data[0]) }, opts)
	if err != nil {
		return nil, err
	}
	t.w = w
	return t, nil
}

// Enabled reports whether the file holds any token now.
func (t *Tokens) Enabled() bool { return len(t.w.Get()) > 0 }

// Accept reports whether got is accepted: one of the file's tokens, or one
// it held before its last change within the grace period. With no tokens
// at all every caller is accepted.
func (t *Tokens) Accept(got string) bool {
	cur := t.w.Get()
	if len(cur) == 0 {
		return true
	}
	if match(cur, got) {
		return true
	}
	t.mu.Lock()
	prev, until := t.prev, t.prevUntil
	t.mu.Unlock()
	if t.now().Before(until) && match(prev, got) {
		return true
	}
	// Perhaps the client read a newer Secret than this server has seen.
	cur = t.w.Fresh(refusedRecheck)
	return len(cur) == 0 || match(cur, got)
}

// match compares got with every token in constant time per token.
func match(toks []string, got string) bool {
	ok := 0
	for _, tok := range toks {
		ok |= subtle.ConstantTimeCompare([]byte(tok), []byte(got))
	}
	return ok == 1 && got != ""
}

// Password is a secret read whole from path, without its trailing line
// break (a password for Redis); the file must exist.
func Password(path string, opts Options[string]) (*Watched[string], error) {
	return Watch([]string{path}, func(data [][]byte) (string, error) {
		if data[0] == nil {
			return "", absent(path)
		}
		return strings.TrimRight(string(data[0]), "\r\n"), nil
	}, opts)
}
