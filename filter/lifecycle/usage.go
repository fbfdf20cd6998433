package lifecycle

import "bytes"

// usageKey is the key whose number ResponseData reads: OpenAI answers carry
// it in "usage" (a JSON body's, a stream's final usage chunk). In a JSON
// string a quote is escaped, so the key cannot match inside generated text;
// "prompt_tokens_details" does not match either.
var usageKey = []byte(`"prompt_tokens"`)

// maxUsageDigits bounds the number read: more digits are not a token count.
const maxUsageDigits = 12

// usageScan finds `"prompt_tokens": N` in an answer fed piece by piece,
// wherever the pieces split it, without copying them.
type usageScan struct {
	st       uint8 // scanKey, scanColon, scanValue
	k        int   // bytes of usageKey matched at the end of the last piece
	val      int64
	digits   int
	reported bool // ResponseData used a value
}

const (
	scanKey uint8 = iota
	scanColon
	scanValue
)

// feed scans p and returns the first complete value found (one followed by
// a byte that is not a digit).
func (u *usageScan) feed(p []byte) (int64, bool) {
	for i := 0; i < len(p); {
		switch u.st {
		case scanKey:
			if u.k > 0 { // a match split by the last piece's end
				n := min(len(usageKey)-u.k, len(p)-i)
				if !bytes.Equal(p[i:i+n], usageKey[u.k:u.k+n]) {
					u.k = 0
					continue // rescan from i
				}
				u.k += n
				i += n
				if u.k == len(usageKey) {
					u.k, u.st = 0, scanColon
				}
				continue
			}
			if j := bytes.Index(p[i:], usageKey); j >= 0 {
				i += j + len(usageKey)
				u.st = scanColon
				continue
			}
			// The key may begin in the last bytes.
			for j := max(i, len(p)-len(usageKey)+1); j < len(p); j++ {
				if bytes.HasPrefix(usageKey, p[j:]) {
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
					return u.val, true
				}
			}
		}
	}
	return 0, false
}

func space(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }
