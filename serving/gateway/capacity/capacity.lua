-- One model's adaptive capacity, shared by every gateway replica (see serving/gateway/capacity/store.py).
--
-- KEYS (all under the fair queue's hash tag {fq:<model>}: one Redis Cluster slot, so the fair
-- queue's script may read the capacity in the same call):
--   1 state  hash: slots (per replica), changed (window of the last change), move, decided
--            (the last window the law ran for)
--   2 lease  string: the gateway process running the law for the window just closed
--   3..      the window ring: RING hashes; window w lives in KEYS[3 + w % RING] with fields
--            w (its index), p:<owner> (each reporting process's most requests in flight in the
--            window: a process reports twice per window, so its reports are maxed, and the
--            processes' maxima summed when read), t<bucket> and i<bucket> (TTFT and ITL
--            histogram counts, serving/gateway/capacity/histogram.py)
-- ARGV: op, window length (us), then per op.
--
-- Windows are numbered by Redis TIME, so every replica agrees on them. Every key has a TTL and
-- the ring is a fixed number of keys: nothing here grows without bound under noeviction.

local op, window_us = ARGV[1], tonumber(ARGV[2])
local STATE, LEASE = KEYS[1], KEYS[2]
local RING = #KEYS - 2
local KEEP_S = 86400  -- an idle model's capacity is forgotten after a day: it starts at its ceiling again
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local current = math.floor(now / window_us)

local function ring_key(w) return KEYS[3 + (w % RING)] end

local function state()
  local s = redis.call('HMGET', STATE, 'slots', 'changed', 'move', 'decided')
  return {tonumber(s[1]) or -1, s[2] or '', s[3] or '', tonumber(s[4]) or -1}
end

-- `peak`: the reporter's most requests in flight since its last report; ARGV[first..]: pairs of
-- histogram field, count.
local function report(peak, owner, first)
  local key = ring_key(current)
  if redis.call('HGET', key, 'w') ~= tostring(current) then
    redis.call('DEL', key)  -- the window RING windows ago: long decided
    redis.call('HSET', key, 'w', current)
  end
  local mine = 'p:' .. owner
  if tonumber(peak) > (tonumber(redis.call('HGET', key, mine)) or 0) then redis.call('HSET', key, mine, peak) end
  for i = first, #ARGV - 1, 2 do redis.call('HINCRBY', key, ARGV[i], ARGV[i + 1]) end
  redis.call('PEXPIRE', key, math.ceil(window_us * RING * 2 / 1000))
end

-- The windows (closed - count, closed] still in the ring, newest first: {w, peak, field, count, ...}.
local function windows(closed, count)
  local out = {}
  for w = closed, math.max(0, closed - count + 1), -1 do
    local key = ring_key(w)
    if redis.call('HGET', key, 'w') == tostring(w) then
      local fields = redis.call('HGETALL', key)
      local row, peak = {w, '0'}, 0
      for i = 1, #fields, 2 do
        local name = fields[i]
        if string.sub(name, 1, 2) == 'p:' then peak = peak + tonumber(fields[i + 1])
        elseif name ~= 'w' then row[#row + 1] = name; row[#row + 1] = fields[i + 1] end
      end
      row[2] = tostring(peak)
      out[#out + 1] = row
    end
  end
  return out
end

if op == 'tick' then
  -- ARGV[3] peak, [4] owner, [5] lease (ms), [6] windows the law may read, [7..] histogram pairs.
  -- Report this process's samples, then claim the law's run for the window just closed if nobody
  -- ran it yet and nobody holds the lease: {1, state..., closed, windows} to the claimant,
  -- {0, state..., current} to everyone else.
  local owner, lease_ms, count = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
  report(ARGV[3], owner, 7)
  local s = state()
  local closed = current - 1
  if s[4] >= closed then return {0, s[1], s[2], s[3], s[4], current} end
  local holder = redis.call('GET', LEASE)
  if holder and holder ~= owner then return {0, s[1], s[2], s[3], s[4], current} end
  redis.call('SET', LEASE, owner, 'PX', lease_ms)
  return {1, s[1], s[2], s[3], s[4], closed, windows(closed, count)}

elseif op == 'decide' then
  -- ARGV[3] owner, [4] the closed window, [5] slots, [6] changed, [7] move. Stored only by the
  -- lease's holder, once per window: a claimant that stalled past its lease changes nothing.
  local owner, closed = ARGV[3], tonumber(ARGV[4])
  local s = state()
  if redis.call('GET', LEASE) ~= owner or s[4] >= closed then return {0, s[1]} end
  redis.call('HSET', STATE, 'slots', ARGV[5], 'changed', ARGV[6], 'move', ARGV[7], 'decided', closed)
  redis.call('EXPIRE', STATE, KEEP_S)
  redis.call('DEL', LEASE)
  return {1, tonumber(ARGV[5])}

elseif op == 'read' then
  local s = state()
  return {s[1], s[2], s[3], s[4], current}
end
return redis.error_reply('unknown capacity op ' .. tostring(op))
