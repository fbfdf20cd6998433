package redisstore

import "github.com/redis/go-redis/v9"

// Every script touches only keys of one cluster, all of which share the
// hash tag {prefix:cluster}, so each script runs on one Redis Cluster slot.
// Keys that are known up front are passed in KEYS; EvictHost and Stats
// derive per-hash and per-host key names from the base, which stay in the
// same slot because they carry the same tag.
//
// Times are milliseconds since the epoch, passed in ARGV by the caller (so
// tests can drive a fake clock and every replica of the metadata center
// agrees with the scores it wrote). An entry or lease is alive while its
// score is strictly greater than now.

// leaseLib maintains the per-host aggregates next to the leases, so a load
// query is two HGETALLs instead of a scan of every lease. Expired leases are
// swept, at most 512 per call, by whichever script touches the cluster's
// leases next.
const leaseLib = `
local function drop(lr, lq, host, p)
  if redis.call('HINCRBY', lr, host, -1) <= 0 then
    redis.call('HDEL', lr, host)
    redis.call('HDEL', lq, host)
  elseif p > 0 then
    if redis.call('HINCRBY', lq, host, -p) <= 0 then redis.call('HDEL', lq, host) end
  end
end
local function sweep(lx, lp, lr, lq, now)
  local dead = redis.call('ZRANGEBYSCORE', lx, '-inf', now, 'LIMIT', 0, 512)
  for _, m in ipairs(dead) do
    local p = tonumber(redis.call('HGET', lp, m)) or 0
    redis.call('HDEL', lp, m)
    redis.call('ZREM', lx, m)
    drop(lr, lq, string.match(m, '^[^|]*'), p)
  end
end
`

// KEYS: lx lp lr lq. ARGV: now expiry ttl host member prompt.
const addSrc = leaseLib + `
local lx, lp, lr, lq = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local host, m, p = ARGV[4], ARGV[5], tonumber(ARGV[6])
sweep(lx, lp, lr, lq, ARGV[1])
local old = redis.call('HGET', lp, m)
if old then
  local d = p - tonumber(old)
  if d ~= 0 and redis.call('HINCRBY', lq, host, d) <= 0 then redis.call('HDEL', lq, host) end
else
  redis.call('HINCRBY', lr, host, 1)
  if p > 0 then redis.call('HINCRBY', lq, host, ARGV[6]) end
end
redis.call('HSET', lp, m, ARGV[6])
redis.call('ZADD', lx, ARGV[2], m)
for i = 1, 4 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
return 1
`

// KEYS: lx lp lr lq. ARGV: now host member.
const firstTokenSrc = leaseLib + `
local lx, lp, lr, lq = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
sweep(lx, lp, lr, lq, ARGV[1])
local old = tonumber(redis.call('HGET', lp, ARGV[3]))
if old and old > 0 then
  redis.call('HSET', lp, ARGV[3], 0)
  if redis.call('HINCRBY', lq, ARGV[2], -old) <= 0 then redis.call('HDEL', lq, ARGV[2]) end
end
return 1
`

// KEYS: lx lp lr lq. ARGV: now host member.
const deleteSrc = leaseLib + `
local lx, lp, lr, lq = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
sweep(lx, lp, lr, lq, ARGV[1])
local old = redis.call('HGET', lp, ARGV[3])
if old then
  redis.call('HDEL', lp, ARGV[3])
  redis.call('ZREM', lx, ARGV[3])
  drop(lr, lq, ARGV[2], tonumber(old))
end
return 1
`

// queryLib computes each host's leading run in two phases.
//
// Wide (at least as many candidate hosts as levels left, e.g. a system
// prompt every pod holds): the candidates sit in a scratch sorted set and a
// level costs two counts inside Redis (ZINTERCARD with the hash's set, and
// ZCOUNT of its entries that are expired or due a refresh); only when
// hosts drop out, or entries need a TTL refresh, does the level take the
// exact path that moves host names into Lua (ZMSCORE). Moving 64 names per
// level into Lua was most of a 64-host query's cost. The scratch key
// carries the cluster's hash tag, is not replicated (REPL_NONE) and is
// deleted before the script ends.
//
// Narrow (fewer hosts than levels left): host by host, one ZMSCORE over the
// remaining hashes on the host's own set, so a 64-block prompt costs a few
// calls instead of 64.
//
// Matched entries whose expiry is older than ARGV[4] get their TTL
// refreshed (coalesced so that hot prefixes do not turn every read into
// writes). Reply: "host\tlength\t..." in one string, which the Go side
// splits far more cheaply than a nested array.
const queryLib = `
local function touch(k, hash, host, exp, ttl, base)
  redis.call('ZADD', KEYS[k], 'XX', exp, host)
  redis.call('PEXPIRE', KEYS[k], ttl)
  local ek = base .. ':e:' .. host
  redis.call('ZADD', ek, 'XX', exp, hash)
  redis.call('PEXPIRE', ek, ttl)
end
local function scratch(...)
  redis.set_repl(redis.REPL_NONE)
  local r = redis.call(...)
  redis.set_repl(redis.REPL_ALL)
  return r
end
local function query(first, hashArg, now, exp, ttl, stale, base)
  local n = #KEYS - first + 1
  if n <= 0 then return '' end
  local nowN, staleN = tonumber(now), tonumber(stale)
  local live, old = '(' .. now, '(' .. stale
  local res, touched = {}, {}
  for _, h in ipairs(redis.call('ZRANGEBYSCORE', KEYS[first], live, old)) do
    touch(first, ARGV[hashArg], h, exp, ttl, base)
    touched[h] = true
  end
  local i, cands = 1, nil
  local c = redis.call('ZCOUNT', KEYS[first], live, '+inf')
  if c > 1 and c >= n - 1 then
    local q = base .. ':q'
    scratch('ZRANGESTORE', q, KEYS[first], live, '+inf', 'BYSCORE')
    -- Hashed encoding, so ZINTERCARD looks members up instead of scanning.
    local wide = string.rep('~', 65)
    scratch('ZADD', q, 0, wide)
    scratch('ZREM', q, wide)
    while i < n and c > 0 and c >= n - i do
      local k = KEYS[first + i]
      if redis.call('ZINTERCARD', 2, q, k) ~= c or redis.call('ZCOUNT', k, '-inf', old) > 0 then
        local names = redis.call('ZRANGE', q, 0, -1)
        local sc = redis.call('ZMSCORE', k, unpack(names))
        local gone = {}
        for j, host in ipairs(names) do
          local s = sc[j] and tonumber(sc[j])
          if s and s > nowN then
            if s < staleN then
              touch(first + i, ARGV[hashArg + i], host, exp, ttl, base)
              touched[host] = true
            end
          else
            gone[#gone + 1] = host
            res[#res + 1] = host
            res[#res + 1] = i
          end
        end
        if #gone > 0 then scratch('ZREM', q, unpack(gone)) end
        c = c - #gone
      end
      i = i + 1
    end
    if c > 0 then cands = redis.call('ZRANGE', q, 0, -1) else cands = {} end
    scratch('DEL', q)
  else
    cands = redis.call('ZRANGEBYSCORE', KEYS[first], live, '+inf')
  end
  if #cands > 0 and i < n then
    local hs = {}
    for l = i, n - 1 do hs[#hs + 1] = ARGV[hashArg + l] end
    for _, host in ipairs(cands) do
      local sc = redis.call('ZMSCORE', base .. ':e:' .. host, unpack(hs))
      local len = n
      for j = 1, #hs do
        local s = sc[j] and tonumber(sc[j])
        if not (s and s > nowN) then
          len = i + j - 1
          break
        end
        if s < staleN then
          touch(first + i + j - 1, hs[j], host, exp, ttl, base)
          touched[host] = true
        end
      end
      res[#res + 1] = host
      res[#res + 1] = len
    end
  else
    for _, host in ipairs(cands) do
      res[#res + 1] = host
      res[#res + 1] = n
    end
  end
  for host in pairs(touched) do
    redis.call('ZADD', base .. ':hosts', 'GT', exp, host)
    redis.call('PEXPIRE', base .. ':hosts', ttl)
  end
  return table.concat(res, '\t')
end
`

// KEYS: h-keys. ARGV: now expiry ttl staleBefore base hashes...
const querySrc = queryLib + `
return query(1, 6, ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])
`

// KEYS: lx lp lr lq h-keys. ARGV: now expiry ttl staleBefore base hashes...
// Reply: {lr "host\tn\t...", lq likewise, cache likewise}.
const routeSrc = leaseLib + queryLib + `
local lx, lp, lr, lq = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
sweep(lx, lp, lr, lq, ARGV[1])
return {table.concat(redis.call('HGETALL', lr), '\t'), table.concat(redis.call('HGETALL', lq), '\t'),
  query(5, 6, ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])}
`

// KEYS: lx lp lr lq. ARGV: now. Reply: {lr "host\tn\t...", lq likewise}.
const loadSrc = leaseLib + `
local lx, lp, lr, lq = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
sweep(lx, lp, lr, lq, ARGV[1])
return {table.concat(redis.call('HGETALL', lr), '\t'), table.concat(redis.call('HGETALL', lq), '\t')}
`

// wideAt is the holder count at which a hash's set is moved from the
// compact listpack encoding (scanned linearly by every ZMSCORE) to the
// hashed one: queries test many candidates against exactly these sets
// (a system prompt every pod holds). Adding and removing a member longer
// than zset-max-listpack-value converts the set for good.
const wideAt = "16"

// KEYS: e-key hosts-key h-keys. ARGV: now expiry ttl host hashes...
const saveSrc = `
local ek, hk, host, exp, ttl = KEYS[1], KEYS[2], ARGV[4], ARGV[2], ARGV[3]
local wide = string.rep('~', 65)
for i = 3, #KEYS do
  if redis.call('ZADD', KEYS[i], exp, host) == 1 and redis.call('ZCARD', KEYS[i]) == ` + wideAt + ` then
    redis.call('ZADD', KEYS[i], 0, wide)
    redis.call('ZREM', KEYS[i], wide)
  end
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', ARGV[1])
  redis.call('PEXPIRE', KEYS[i], ttl)
  redis.call('ZADD', ek, exp, ARGV[i + 2])
end
redis.call('ZREMRANGEBYSCORE', ek, '-inf', ARGV[1])
redis.call('PEXPIRE', ek, ttl)
redis.call('ZADD', hk, exp, host)
redis.call('ZREMRANGEBYSCORE', hk, '-inf', ARGV[1])
redis.call('PEXPIRE', hk, ttl)
return 1
`

// KEYS: e-key hosts-key h-keys. ARGV: host hashes...
const evictSrc = `
local ek, hk, host = KEYS[1], KEYS[2], ARGV[1]
for i = 3, #KEYS do
  redis.call('ZREM', KEYS[i], host)
  redis.call('ZREM', ek, ARGV[i - 1])
end
if redis.call('ZCARD', ek) == 0 then redis.call('ZREM', hk, host) end
return 1
`

// KEYS: e-key hosts-key. ARGV: host base.
const evictHostSrc = `
local ek, hk, host, base = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local hs = redis.call('ZRANGE', ek, 0, -1)
for _, h in ipairs(hs) do redis.call('ZREM', base .. ':h:' .. h, host) end
redis.call('DEL', ek)
redis.call('ZREM', hk, host)
return #hs
`

// KEYS: lx hosts-key. ARGV: now base. Reply: {live leases, live entries}.
const statsSrc = `
local live = '(' .. ARGV[1]
local leases = redis.call('ZCOUNT', KEYS[1], live, '+inf')
local entries = 0
for _, h in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], live, '+inf')) do
  entries = entries + redis.call('ZCOUNT', ARGV[2] .. ':e:' .. h, live, '+inf')
end
return {leases, entries}
`

// scripts are the compiled forms, one set per Store (go-redis keeps each
// script's SHA1 for EVALSHA).
type scripts struct {
	add, firstToken, del, query, route, load, save, evict, evictHost, stats *redis.Script
}

func newScripts() scripts {
	return scripts{
		add:        redis.NewScript(addSrc),
		firstToken: redis.NewScript(firstTokenSrc),
		del:        redis.NewScript(deleteSrc),
		query:      redis.NewScript(querySrc),
		route:      redis.NewScript(routeSrc),
		load:       redis.NewScript(loadSrc),
		save:       redis.NewScript(saveSrc),
		evict:      redis.NewScript(evictSrc),
		evictHost:  redis.NewScript(evictHostSrc),
		stats:      redis.NewScript(statsSrc),
	}
}
