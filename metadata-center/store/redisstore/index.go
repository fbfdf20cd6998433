package redisstore

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/istio-llm-filter/istio-llm-filter/prefix"
)

// indexSrc lists what a query would answer: a host's entry counts only
// when its e: record is live and the prefix's holder list (what queries
// read) names it with a live expiry, so the listing shows the index as the
// router sees it, not a bookkeeping set that could disagree with it.
// Read-only; one string "host\thash\thash…" per host.
//
// KEYS: hosts-key px. ARGV: now base.
const indexSrc = holdersLib + `
local live, nowN, base = '(' .. ARGV[1], tonumber(ARGV[1]), ARGV[2]
local out = {}
for _, host in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], live, '+inf')) do
  local row = {host}
  for _, h in ipairs(redis.call('ZRANGEBYSCORE', base .. ':e:' .. host, live, '+inf')) do
    local s = redis.call('HGET', KEYS[2], h)
    local e = s and lookup(s, nil, host)
    if e and e > nowN then row[#row + 1] = h end
  end
  if #row > 1 then out[#out + 1] = table.concat(row, '\t') end
end
return out
`

var indexScript = redis.NewScript(indexSrc)

// CacheIndex implements store.Index. It walks the whole cluster in
// one script, so it is for debugging and checks, not for the request path.
func (s *Store) CacheIndex(ctx context.Context, cluster string) (map[string][]prefix.Hash, error) {
	k := s.keys(cluster)
	rows, err := indexScript.Run(ctx, s.rdb, []string{k.hosts(), k.holders()}, s.ms(), k.base).StringSlice()
	if err != nil {
		return nil, s.wrap("cache index", err)
	}
	out := make(map[string][]prefix.Hash, len(rows))
	for _, row := range rows {
		f := strings.Split(row, "\t")
		hs := make([]prefix.Hash, 0, len(f)-1)
		for _, x := range f[1:] {
			h, err := prefix.ParseHash(x)
			if err != nil {
				return nil, fmt.Errorf("cache index: host %s: %w", f[0], err)
			}
			hs = append(hs, h)
		}
		slices.Sort(hs)
		out[f[0]] = hs
	}
	return out, nil
}
