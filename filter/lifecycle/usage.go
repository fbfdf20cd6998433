package lifecycle

import "bytes"

// The keys whose numbers ResponseData reads: OpenAI answers carry them in
// "usage" (a JSON body's, a stream's final usage chunk), cached_tokens in
// its prompt_tokens_details where the server counts them (vLLM, SGLang and
// our worker do). In a JSON string a quote is escaped, so a key cannot
// match inside generated text; "prompt_tokens_details" does not match
// "prompt_tokens" either.
var (
	promptTokensKey = []byte(`"prompt_tokens"`)
	cachedTokensKey = []byte(`"cached_tokens"`)
)

// maxUsageDigits bounds the number read: more digits are not a token count.
const maxUsageDigits = 12

// usageScan finds `KEY: N` in an answer fed piece by piece, wherever the
// pieces split it, without copying them. The zero value is ready; a
// scanner keeps to one key.
type usageScan struct {
	st     uint8 // scanKey, scanColon, scanValue
	k      int   // bytes of the key matched at the end of the last piece
	val    int64
	digits int
	found  bool // a value was returned: the scan is over
}

const (
	scanKey uint8 = iota
	scanColon
	scanValue
)

// feed scans p for key and returns the first complete value found
// (one followed by a byte that is not a digit); once found, no other.
func (u *usageScan) feed(key, p []byte) (int64, bool) {
	if u.found {
		return 0, false
	}
	for i := 0; i < len(p); {
		switch u.st {
		case scanKey:
			if u.k > 0 { // a match split by the last piece's end
				n := min(len(key)-u.k, len(p)-i)
				if !bytes.Equal(p[i:i+n], key[u.k:u.k+n]) {
					u.k = 0
					continue // rescan from i
				}
				u.k += n
				i += n
				if u.k == len(key) {
					u.k, u.st = 0, scanColon
				}
				continue
			}
			if j := bytes.Index(p[i:], key); j >= 0 {
				i += j + len(key)
				u.st = scanColon
				continue
			}
			// The key may begin in the last bytes.
			for j := max(i, len(p)-len(key)+1); j < len(p); j++ {
				if bytes.HasPrefix(key, p[j:]) {
					u.k = len(p) - j
					break
				}
			}
			return 0, false
		case scanColon:
			c := p[i]
			i++
			switch {
			case c == ':':
				u.st, u.val, u.digits = scanValue, 0, 0
			case !space(c):
				u.st = scanKey
			}
		case scanValue:
			c := p[i]
			switch {
			case space(c) && u.digits == 0:
				i++
			case c >= '0' && c <= '9' && u.digits < maxUsageDigits:
				u.val = u.val*10 + int64(c-'0')
				u.digits++
				i++
			default: // not consumed: it may begin the next key
				u.st = scanKey
				if u.digits > 0 && c != '.' && c != 'e' && c != 'E' && (c < '0' || c > '9') {
					u.found = true
					return u.val, true
				}
			}
		}
	}
	return 0, false
}

func space(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

// usage is what ResponseData reads of one answer: its prompt tokens and,
// where the server reports them, the prompt tokens it served from its KV
// cache.
type usage struct {
	prompt, cached             usageScan
	promptTokens, cachedTokens int64
	checked                    bool // the cache belief was checked (Checker.ObserveCache)
}

// feed scans one piece of the answer and returns the prompt tokens when
// this piece completed them.
func (u *usage) feed(p []byte) (promptTokens int64, ok bool) {
	if v, found := u.cached.feed(cachedTokensKey, p); found {
		u.cachedTokens = v
	}
	if promptTokens, ok = u.prompt.feed(promptTokensKey, p); ok {
		u.promptTokens = promptTokens
	}
	return promptTokens, ok
}
