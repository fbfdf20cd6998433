package redisstore

import "github.com/redis/go-redis/v9"

// Every script touches only keys of one cluster, all of which share the
// hash tag {prefix:cluster}, so each script runs on one Redis Cluster slot.
// Keys that are known up front are passed in KEYS (prefix hashes are
// fields of {P:C}:px, passed in ARGV); the query's refresh,
// EvictHostBefore and Stats derive per-host key names from the base, which
// stay in the same slot because they carry the same tag.
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

// holdersLib reads and writes the holder list of one prefix: the field
// <hash> of the cluster's hash {P:C}:px holds "minExpiry" followed by
// ";host offset" records sorted by host, a record's expiry being minExpiry
// plus its offset (usually a few digits, often "0", instead of 13: every
// byte handed to Lua costs, as its string interning hashes them all), dead
// records dropped on every full rewrite. One field per prefix in one hash lets a query fetch every level
// with a single HMGET, whose cost per level is a field lookup rather than
// a key's (slot check, key and expiry lookups, a 70-byte name sent and
// copied twice); the leading minimum (exact after a full rewrite, a lower
// bound after an in-place save) tells, without parsing, that every record
// is live and none is due a refresh; and two levels written by the same
// saves and refreshes are byte-identical, which Lua (whose strings are all
// interned) compares in O(1). Redis 7.0 has no per-field TTL, so
// {P:C}:pxt scores each prefix with its newest record's expiry, and saves
// sweep the fields whose every record is dead (dropDead).
const holdersLib = `
local function lowest(s)
  return tonumber(string.match(s, '^%d+')) or 0
end
local function parse(s)
  local m = {}
  if s then
    local low = lowest(s)
    for h, e in string.gmatch(s, ';([^ ;]+) (%d+)') do m[h] = low + tonumber(e) end
  end
  return m
end
local function build(m, nowN)
  local hs, low = {}, nil
  for h, e in pairs(m) do
    if e > nowN then
      hs[#hs + 1] = h
      if not low or e < low then low = e end
    end
  end
  if not low then return '', 0 end
  table.sort(hs)
  for i, h in ipairs(hs) do hs[i] = ';' .. h .. ' ' .. string.format('%.0f', m[h] - low) end
  return string.format('%.0f', low) .. table.concat(hs), #hs
end
local function hostsOf(s)
  return (string.gsub(string.sub(s, (string.find(s, ';', 1, true))), ' %d+', ''))
end
local function lookup(s, m, h)
  if m then return m[h] end
  local p = string.find(s, ';' .. h .. ' ', 1, true)
  if p then return lowest(s) + tonumber(string.match(s, '^%d+', p + #h + 2)) end
  return nil
end
local function dropDead(px, pxt, now)
  local dead = redis.call('ZRANGEBYSCORE', pxt, '-inf', now, 'LIMIT', 0, 256)
  if #dead > 0 then
    redis.call('HDEL', px, unpack(dead))
    redis.call('ZREM', pxt, unpack(dead))
  end
end
`

// queryLib walks the levels once. While every level so far has the same
// holders as level 0, all live and none due a refresh (a system prompt
// every pod holds), the candidates are level 0's string itself and a level
// costs a string comparison. Only a level of the same length has its host
// names compared (extracting them from a 64-record list costs more than
// the rest of such a query); one of another length ends the group even if
// only its offsets' widths differ, which stays exact: its hosts simply go
// on as candidates. When that group breaks up, it goes to the
// reply whole with the level its hosts reached, and the few that go on
// are kept in a Lua table: a level identical to the one before changes
// nothing; otherwise it is parsed (or, for a handful of
// candidates, searched) and hosts that do not hold it live leave with
// their run length. Holes stay exact because every level is looked at
// until no candidate is left.
//
// Matched records whose expiry is older than staleBefore get their TTL
// refreshed (the level is rewritten once for all its stale candidates, so
// identical levels stay identical; a level byte-identical to the one
// rewritten before it takes the same new string without another parse, and
// each host's e: entries are renewed by one ZADD at the end, not one per
// level: the refresh of a 64-host system prompt was the dearest thing a
// query did, once a touch interval). Reply: the group (level 0's holder
// list, or "" when there was none) and the length its hosts reached, then
// "host\tlength\t..." for the hosts that went further, whose entry wins.
// The group goes back as Redis stored it: Lua's pattern matching would
// spend more on rewriting 64 records than the whole rest of the query,
// and the Go side splits flat strings far more cheaply than nested arrays.
const queryLib = holdersLib + `
local function query(px, pxt, first, now, exp, ttl, stale, base)
  local n = #ARGV - first + 1
  if n <= 0 then return '', 0, '' end
  local nowN, staleN, expN = tonumber(now), tonumber(stale), tonumber(exp)
  local vals = redis.call('HMGET', px, unpack(ARGV, first))
  local res, touched, group = {}, {}, 0
  local lastSrc, lastHosts, lastOut
  local levels = {}
  local function refresh(i, hosts)
    local s = vals[i + 1]
    local out = lastOut
    if s ~= lastSrc or hosts ~= lastHosts then
      local m = parse(s)
      for _, h in ipairs(hosts) do m[h] = expN end
      out = (build(m, nowN))
      lastSrc, lastHosts, lastOut = s, hosts, out
    end
    local hash = ARGV[first + i]
    for _, h in ipairs(hosts) do
      local t = touched[h]
      if not t then
        t = {}
        touched[h] = t
      end
      t[#t + 1] = exp
      t[#t + 1] = hash
    end
    levels[#levels + 1] = hash
    levels[#levels + 1] = out
  end
  local s0 = vals[1]
  if not s0 then return '', 0, '' end
  local i = 1
  local cands, nc, stl = {}, 0, {}
  local prev = s0
  if lowest(s0) > staleN then
    local sig = nil
    while i < n do
      local s = vals[i + 1]
      if s ~= s0 then
        if not (s and lowest(s) > staleN) then break end
        if #s ~= #s0 then break end
        sig = sig or hostsOf(s0)
        if hostsOf(s) ~= sig then break end
      end
      i = i + 1
    end
    if i == n then return s0, n, '' end
    group = i
    local s = vals[i + 1]
    if s then
      for h, e in pairs(parse(s)) do
        if e > nowN and string.find(s0, ';' .. h .. ' ', 1, true) then
          cands[h] = true
          nc = nc + 1
          if e < staleN then stl[#stl + 1] = h end
        end
      end
    end
    prev = s
  else
    for h, e in pairs(parse(s0)) do
      if e > nowN then
        cands[h] = true
        nc = nc + 1
        if e < staleN then stl[#stl + 1] = h end
      end
    end
    i = 0
  end
  if #stl > 0 then refresh(i, stl) end
  i = i + 1
  while i < n and nc > 0 do
    local s = vals[i + 1]
    if s ~= prev then
      stl = {}
      local m = nil
      if s and nc > 4 then m = parse(s) end
      for h in pairs(cands) do
        local e = s and lookup(s, m, h)
        if not (e and e > nowN) then
          cands[h] = nil
          nc = nc - 1
          res[#res + 1] = h
          res[#res + 1] = i
        elseif e < staleN then
          stl[#stl + 1] = h
        end
      end
      prev = s
    end
    if #stl > 0 and nc > 0 then refresh(i, stl) end
    i = i + 1
  end
  for h in pairs(cands) do
    res[#res + 1] = h
    res[#res + 1] = n
  end
  if #levels > 0 then
    local times = {}
    for j = 1, #levels, 2 do
      times[#times + 1] = exp
      times[#times + 1] = levels[j]
    end
    for j = 1, #levels, 2048 do
      redis.call('HSET', px, unpack(levels, j, math.min(j + 2047, #levels)))
      redis.call('ZADD', pxt, 'GT', unpack(times, j, math.min(j + 2047, #times)))
    end
    redis.call('PEXPIRE', px, ttl)
    redis.call('PEXPIRE', pxt, ttl)
    local hk = base .. ':hosts'
    for h, t in pairs(touched) do
      local ek = base .. ':e:' .. h
      for j = 1, #t, 2048 do
        redis.call('ZADD', ek, 'XX', unpack(t, j, math.min(j + 2047, #t)))
      end
      redis.call('PEXPIRE', ek, ttl)
      redis.call('ZADD', hk, 'GT', exp, h)
    end
    redis.call('PEXPIRE', hk, ttl)
  end
  if group == 0 then return '', 0, table.concat(res, '\t') end
  return s0, group, table.concat(res, '\t')
end
`

// KEYS: px pxt. ARGV: now expiry ttl staleBefore base hashes...
// Reply: {group, group length, rest}.
const querySrc = queryLib + `
return {query(KEYS[1], KEYS[2], 6, ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])}
`

// KEYS: lx lp lr lq px pxt. ARGV: now expiry ttl staleBefore base hashes...
// Reply: {cache group, group length, cache rest}. The load aggregates, the
// pods' signals and registrations are read by plain HGETALLs pipelined
// after it (routepipe.go): Redis answers those from C, where handing 64
// hosts' counts to Lua and joining them into strings cost about a third of
// the script (docs/metadata-center.md, "One round trip per call").
const routeSrc = leaseLib + queryLib + `
sweep(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[1])
return {query(KEYS[5], KEYS[6], 6, ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5])}
`

// KEYS: sig. ARGV: host report keyTTL staleBefore max. A report is
// "waiting running kvUtil prefillTokens unixMillis". Past max hosts, the
// stale reports are dropped.
const signalsSrc = `
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
if redis.call('HLEN', KEYS[1]) > tonumber(ARGV[5]) then
  local all = redis.call('HGETALL', KEYS[1])
  local before = tonumber(ARGV[4])
  for i = 1, #all, 2 do
    local at = tonumber(string.match(all[i + 1], '(%d+)$'))
    if not at or at < before then redis.call('HDEL', KEYS[1], all[i]) end
  end
end
return 1
`

// KEYS: lx lp lr lq. ARGV: now. Reply: {lr "host\tn\t...", lq likewise}.
const loadSrc = leaseLib + `
local lx, lp, lr, lq = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
sweep(lx, lp, lr, lq, ARGV[1])
return {table.concat(redis.call('HGETALL', lr), '\t'), table.concat(redis.call('HGETALL', lq), '\t')}
`

// KEYS: e-key hosts-key v-key px pxt x-key. ARGV: now expiry ttl host
// saveID refreshOnly savedAt memory maxEntries hashes...
//
// A host saving a prefix it already holds (every request of a shared
// system prompt does) gets its expiry replaced in place: the leading
// minimum stays a valid lower bound because expiries only grow, so no
// parse is needed. A new holder, a dead record or an expiry that went
// backwards (replicas' clocks) takes the full rewrite, which also drops
// the dead records and makes the minimum exact again. The v-key records
// each entry's last save, "now saveID", for evictions and retractions;
// its fields of entries that expired go with them. With refreshOnly "1"
// a prefix whose holder list lacks a live record of host is skipped: a
// confirmation never inserts (an eviction may have removed the entry);
// and the ones it renews keep their save time, taking only the save id.
// A save is dated savedAt (at most now): a prefix the x-key says host
// evicted at or after that (or a host evict-all at or after it), less than
// memory ms ago, is skipped, and an entry whose last save is dated later
// keeps that save.
//
// The e-key orders host's entries by expiry, that is by last save or
// refresh; within one save the i-th hash scores i/1024 ms lower (from the
// 1,024th on alike; liveness, compared in whole milliseconds, is
// unchanged), so that with maxEntries > 0 the entries past it go least
// recent first and, of one save, the prompt's last blocks first
// (store.Index.SaveCacheAs).
// Reply: how many prefixes host now holds by this save.
const saveSrc = unholdLib + `
local ek, hk, vk, px, pxt, xk, host, exp, ttl = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], ARGV[4], ARGV[2], ARGV[3]
local nowN, expN, saved = tonumber(ARGV[1]), tonumber(exp), tonumber(ARGV[7])
local version = ARGV[7] .. ' ' .. ARGV[5]
local refresh = ARGV[6] == '1'
local forgotten = nowN - tonumber(ARGV[8])
local cap = tonumber(ARGV[9])
local evictedAll = tonumber(redis.call('ZSCORE', xk, '*') or '0')
-- hold returns the prefix's new holder list, or nil to leave it alone.
local function hold(s)
  if not s and refresh then return nil end
  if s then
    local low = lowest(s)
    if low > nowN and expN >= low then
      local p = string.find(s, ';' .. host .. ' ', 1, true)
      if p then
        local a = p + #host + 2
        local b = string.find(s, ';', a, true)
        return string.sub(s, 1, a - 1) .. string.format('%.0f', expN - low) .. (b and string.sub(s, b) or '')
      end
      if refresh then return nil end
    end
  end
  local m = parse(s)
  if refresh and not (m[host] and m[host] > nowN) then return nil end
  m[host] = expN
  return (build(m, nowN))
end
-- 512 hashes per HMGET, HSET and ZADD rather than a call per hash (Lua's
-- unpack stops at a few thousand values, and the API allows 4096 hashes).
local held = 0
for i = 10, #ARGV, 512 do
  local j = math.min(i + 511, #ARGV)
  local cur = redis.call('HMGET', px, unpack(ARGV, i, j))
  local olds = redis.call('HMGET', vk, unpack(ARGV, i, j))
  local evs = refresh or redis.call('ZMSCORE', xk, unpack(ARGV, i, j))
  local lists, scores, escores, vers = {}, {}, {}, {}
  for k = 1, #cur do
    local h = ARGV[i + k - 1]
    local v, ev = nil, refresh or math.max(evictedAll, tonumber(evs[k] or '0'))
    if refresh or ev < saved or ev <= forgotten then v = hold(cur[k]) end
    if v then
      held = held + 1
      lists[#lists + 1] = h
      lists[#lists + 1] = v
      scores[#scores + 1] = exp
      scores[#scores + 1] = h
      escores[#escores + 1] = string.format('%.4f', expN - math.min(i + k - 11, 1023) / 1024)
      escores[#escores + 1] = h
      vers[#vers + 1] = h
      local oldAt = string.match(olds[k] or '', '^%d+') or '0'
      if refresh then
        vers[#vers + 1] = oldAt .. ' ' .. ARGV[5]
      elseif tonumber(oldAt) > saved then
        vers[#vers + 1] = olds[k]
      else
        vers[#vers + 1] = version
      end
    end
  end
  if #lists > 0 then
    redis.call('HSET', px, unpack(lists))
    redis.call('ZADD', pxt, 'GT', unpack(scores))
    redis.call('ZADD', ek, unpack(escores))
    redis.call('HSET', vk, unpack(vers))
  end
end
if held == 0 then return 0 end
while true do
  local dead = redis.call('ZRANGEBYSCORE', ek, '-inf', ARGV[1], 'LIMIT', 0, 512)
  if #dead == 0 then break end
  redis.call('HDEL', vk, unpack(dead))
  redis.call('ZREM', ek, unpack(dead))
end
if cap > 0 then
  local over = redis.call('ZCARD', ek) - cap
  if over > 0 then
    local gone = redis.call('ZRANGE', ek, 0, over - 1)
    for _, h in ipairs(gone) do unhold(px, pxt, h, host, nowN) end
    redis.call('ZREMRANGEBYRANK', ek, 0, over - 1)
    for k = 1, #gone, 512 do redis.call('HDEL', vk, unpack(gone, k, math.min(k + 511, #gone))) end
    held = math.min(held, cap)
  end
end
dropDead(px, pxt, ARGV[1])
for _, k in ipairs({ek, vk, px, pxt}) do redis.call('PEXPIRE', k, ttl) end
redis.call('ZADD', hk, exp, host)
redis.call('ZREMRANGEBYSCORE', hk, '-inf', ARGV[1])
redis.call('PEXPIRE', hk, ttl)
return held
`

// unholdLib removes one host from a prefix's holder list, deleting the
// field when nobody is left; version reads an entry's last save.
const unholdLib = holdersLib + `
local function unhold(px, pxt, hash, host, nowN)
  local s = redis.call('HGET', px, hash)
  if not s or not string.find(s, ';' .. host .. ' ', 1, true) then return end
  local m = parse(s)
  m[host] = nil
  local v, c = build(m, nowN)
  if c == 0 then
    redis.call('HDEL', px, hash)
    redis.call('ZREM', pxt, hash)
  else
    redis.call('HSET', px, hash, v)
  end
end
-- remember records in the x-key that the members were evicted at before
-- (Unix ms), keeping a later time already there, and forgets what is
-- older than memory ms.
local function remember(xk, before, memory, nowN, ...)
  local members = {...}
  for i = 1, #members, 256 do
    local args = {}
    for k = i, math.min(i + 255, #members) do
      args[#args + 1] = before
      args[#args + 1] = members[k]
    end
    redis.call('ZADD', xk, 'GT', unpack(args))
  end
  redis.call('ZREMRANGEBYSCORE', xk, '-inf', '(' .. string.format('%.0f', nowN - tonumber(memory)))
  redis.call('PEXPIRE', xk, memory)
end

local function version(vk, hash)
  local v = redis.call('HGET', vk, hash)
  if not v then return 0, '' end
  local at, id = string.match(v, '^(%d+) ?(.*)$')
  return tonumber(at) or 0, id or ''
end
`

// KEYS: e-key hosts-key v-key px pxt x-key. ARGV: now host before memory
// hashes... Entries saved after before (Unix ms; 0: never) stay. With
// before > 0 the x-key remembers the eviction for memory ms, so that a
// save dated before it that arrives later is skipped (saveSrc).
const evictSrc = unholdLib + `
local ek, hk, vk, px, pxt, xk, host, nowN, before = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], ARGV[2], tonumber(ARGV[1]), tonumber(ARGV[3])
if before > 0 then
  remember(xk, before, ARGV[4], nowN, unpack(ARGV, 5))
end
for i = 5, #ARGV do
  local h = ARGV[i]
  local gone = before <= 0
  if not gone then gone = version(vk, h) <= before end
  if gone then
    unhold(px, pxt, h, host, nowN)
    redis.call('ZREM', ek, h)
    redis.call('HDEL', vk, h)
  end
end
if redis.call('ZCARD', ek) == 0 then redis.call('ZREM', hk, host) end
return 1
`

// KEYS: e-key hosts-key v-key px pxt x-key. ARGV: now host saveID
// hashes... Only entries whose last save carried saveID go.
const retractSrc = unholdLib + `
local ek, hk, vk, px, pxt, host, nowN, id = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[2], tonumber(ARGV[1]), ARGV[3]
for i = 4, #ARGV do
  local h = ARGV[i]
  local _, by = version(vk, h)
  if by == id then
    unhold(px, pxt, h, host, nowN)
    redis.call('ZREM', ek, h)
    redis.call('HDEL', vk, h)
  end
end
if redis.call('ZCARD', ek) == 0 then redis.call('ZREM', hk, host) end
return 1
`

// KEYS: e-key hosts-key v-key px pxt x-key. ARGV: now host before memory.
// With before (Unix ms) > 0, entries saved after it stay (a pod's start
// epoch), and the x-key remembers it as member '*' (evictSrc).
const evictHostSrc = unholdLib + `
local ek, hk, vk, px, pxt, xk, host, nowN, before = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], ARGV[2], tonumber(ARGV[1]), tonumber(ARGV[3])
if before > 0 then remember(xk, before, ARGV[4], nowN, '*') end
local hs = redis.call('ZRANGE', ek, 0, -1)
local n = 0
for _, h in ipairs(hs) do
  if before <= 0 or version(vk, h) <= before then
    unhold(px, pxt, h, host, nowN)
    n = n + 1
    if before > 0 then
      redis.call('ZREM', ek, h)
      redis.call('HDEL', vk, h)
    end
  end
end
if before <= 0 then
  redis.call('DEL', ek, vk)
end
if redis.call('ZCARD', ek) == 0 then redis.call('ZREM', hk, host) end
return n
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
	add, firstToken, del, query, route, load, save, evict, retract, evictHost, stats, signals *redis.Script
}

func newScripts() scripts {
	return scripts{
		add:        redis.NewScript(addSrc),
		firstToken: redis.NewScript(firstTokenSrc),
		del:        redis.NewScript(deleteSrc),
		query:      redis.NewScript(querySrc),
		route:      redis.NewScript(routeSrc),
		signals:    redis.NewScript(signalsSrc),
		load:       redis.NewScript(loadSrc),
		save:       redis.NewScript(saveSrc),
		evict:      redis.NewScript(evictSrc),
		evictHost:  redis.NewScript(evictHostSrc),
		retract:    redis.NewScript(retractSrc),
		stats:      redis.NewScript(statsSrc),
	}
}
