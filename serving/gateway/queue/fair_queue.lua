-- The fair queue of one model, shared by every gateway replica (see serving/gateway/queue/fair_queue.py).
--
-- KEYS (all of one model, hash tag {fq:<model>}, so one Redis Cluster slot):
--   1 state    hash: vt<rank> (virtual time of each tier), svc_us (EWMA of slot hold time), seq
--   2 inflight zset: slot id -> lease expiry (us); ZCARD = requests in flight
--   3 leases   zset: waiter id -> lease expiry (us), for waiters not yet admitted
--   4 waiters  hash: waiter id -> "<Q|S>|<rank>|<owner>|<start>|<finish>|w<weight>|<tenant>" (Q queued, S pushed out)
--   5 tenants  hash: "<rank>|<tenant>" -> "<finish>|<queued>|<served finish>"
--   6 replicas string: live replica count (absent: unknown)
--   7 slots    hash: in-flight slot id -> its tenant
--   8 holders  hash: tenant -> how many slots it holds (tenants holding none are absent)
--   9 capacity hash: slots = the model's adapted capacity per replica (serving/gateway/capacity/
--            capacity.lua writes it; absent: the model is not adaptive, or not measured yet)
--   10 weights hash: tenant -> the weight of its latest slot (only tenants holding slots), for
--            the engine priority's weighted share (serving/gateway/capacity/engine_priority.py)
--   11.. queue zsets, one per tier, highest priority first: waiter id -> start tag
-- ARGV: op, default replicas, per-replica capacity, lease (us), wake channel prefix, each tier's
-- capacity share (comma-separated, non-increasing), reserve share, then per op.
--
-- Times are Redis TIME in integer microseconds, so every gateway replica shares one clock.
-- Waiter ids are "<16-digit seq>:<token>": equal start tags then sort by arrival (FIFO).
-- Every admission checks ZCARD(inflight) < capacity inside this script, so no interleaving
-- of gateway replicas can admit more than capacity.

local op = ARGV[1]
local default_replicas, per_replica = tonumber(ARGV[2]), tonumber(ARGV[3])
local lease, channel = tonumber(ARGV[4]), ARGV[5]
local shares = {}
for share in string.gmatch(ARGV[6], '[^,]+') do shares[#shares + 1] = tonumber(share) end
local reserve_share = tonumber(ARGV[7])
local STATE, INFLIGHT, LEASES, WAITERS, TENANTS, REPLICAS = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local SLOTS, HOLDERS, ADAPTED, WEIGHTS = KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local FIRST_QUEUE = 11
local TIERS = #KEYS - FIRST_QUEUE + 1
local KEEP_S = 86400  -- idle models' keys vanish after a day
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])

local function int(x) return string.format('%.0f', x) end
local function tag(x) return string.format('%.17g', x) end
local function queue_key(rank) return KEYS[FIRST_QUEUE + rank] end

-- Per replica: max_ongoing_requests, or less while the adaptive capacity says the engine is
-- slower than its latency target at that load (never above it: Serve would queue the rest).
local function capacity()
  local live = tonumber(redis.call('GET', REPLICAS) or '')
  local replicas = live or default_replicas
  local per = per_replica
  local adapted = tonumber(redis.call('HGET', ADAPTED, 'slots') or '')
  if adapted then per = math.max(1, math.min(adapted, per_replica)) end
  return math.max(replicas, 1) * per, live or -1
end

-- A tier may fill only its share of the capacity: what lower tiers leave free is there at once
-- for a higher tier's request. Shares never grow down the tiers, so when the highest waiting tier
-- cannot be admitted, no lower one can.
local function tier_cap(cap, rank) return math.max(1, math.floor(cap * shares[rank + 1] + 1e-9)) end

-- The reserve: the last slots of the capacity go only to tenants holding less than their share,
-- so that a light tenant's request finds a slot free at once on a saturated model instead of
-- waiting for a flooding tenant's request to end (nothing preempts a running request).
-- A tenant's share is the capacity split among the tenants holding slots in proportion to their
-- weights, and never more than half of it: so a tenant flooding alone stops short of the reserve
-- too, and it is there when another tenant's first request comes. On a saturated model every slot
-- that frees is one of the last (in flight is capacity - 1), so this share, not the start tags,
-- decides who gets it: it must be the weighted share, or the weights count for nothing there.
-- (serving/gateway/capacity/engine_priority.py `share_band` reads the same share.)
local function reserved(cap) return math.floor(cap * reserve_share + 1e-9) end

-- Only the reserve is free: `count` in flight leaves no slot for a tenant holding its share.
local function only_reserve_left(count, cap)
  local reserve = reserved(cap)
  return reserve > 0 and count >= cap - reserve
end

-- The sum of the weights of the tenants holding slots, each read from WEIGHTS (1 when absent), so
-- an entry a previous version's script left behind is never counted.
local function holders_weight(holding)
  local total = 0
  if #holding > 0 then
    for _, w in ipairs(redis.call('HMGET', WEIGHTS, unpack(holding))) do total = total + (tonumber(w) or 1) end
  end
  return total
end

-- Whether `tenant`, of `weight`, holds its share: cap x weight / max(total, 2 x weight), where
-- `total` is holders_weight (a tenant holding nothing is under it whatever the others hold).
local function over_share(tenant, weight, cap, total)
  local held = tonumber(redis.call('HGET', HOLDERS, tenant) or '0')
  return held > 0 and held * math.max(total, 2 * weight) >= cap * weight
end

local function has_room(count, cap, rank, tenant, weight)
  if count >= tier_cap(cap, rank) then return false end
  if not only_reserve_left(count, cap) then return true end
  return not over_share(tenant, weight, cap, holders_weight(redis.call('HKEYS', HOLDERS)))
end

local function hold(id, tenant, weight)
  redis.call('ZADD', INFLIGHT, int(now + lease), id)
  redis.call('HSET', SLOTS, id, tenant)
  redis.call('HINCRBY', HOLDERS, tenant, 1)
  redis.call('HSET', WEIGHTS, tenant, tag(weight))
end

-- What the engine priority reads of a tenant that just took a slot: the slots it holds (this one
-- included), how many tenants hold slots, and the sum of their weights (a string: Redis would cut
-- a Lua float to an integer).
local function share_of(tenant)
  local holding = redis.call('HKEYS', HOLDERS)
  return tonumber(redis.call('HGET', HOLDERS, tenant) or '0'), #holding, tag(holders_weight(holding))
end

-- After `id` left INFLIGHT (released or its lease expired).
local function unhold(id)
  local tenant = redis.call('HGET', SLOTS, id)
  if not tenant then return end
  redis.call('HDEL', SLOTS, id)
  if redis.call('HINCRBY', HOLDERS, tenant, -1) <= 0 then
    redis.call('HDEL', HOLDERS, tenant)
    redis.call('HDEL', WEIGHTS, tenant)
  end
end

local function vt_of(rank) return tonumber(redis.call('HGET', STATE, 'vt' .. rank) or '0') end

-- Virtual times and tenants' tags only mean something together: they expire together.
local function keep()
  redis.call('EXPIRE', STATE, KEEP_S)
  redis.call('EXPIRE', TENANTS, KEEP_S)
end

local function tenant_get(rank, tenant)
  local v = redis.call('HGET', TENANTS, rank .. '|' .. tenant)
  if not v then return 0, 0, 0 end
  local f, n, s = string.match(v, '^([^|]+)|([^|]+)|(.+)$')
  return tonumber(f), tonumber(n), tonumber(s)
end

local function tenant_put(rank, tenant, finish, queued, served)
  local field = rank .. '|' .. tenant
  if queued == 0 and finish <= vt_of(rank) then
    redis.call('HDEL', TENANTS, field)  -- max(V, F) = V from now on: the entry says nothing
  else
    redis.call('HSET', TENANTS, field, tag(finish) .. '|' .. queued .. '|' .. tag(served))
  end
end

-- A record without the weight field (written before it existed, by a replica of the previous
-- version during a rolling update) reads as weight 1.
local function parse(rec)
  local s, r, o, st, f, w, tn = string.match(rec, '^(%a)|(%d+)|([^|]*)|([^|]+)|([^|]+)|w([^|]+)|(.*)$')
  if not s then
    s, r, o, st, f, tn = string.match(rec, '^(%a)|(%d+)|([^|]*)|([^|]+)|([^|]+)|(.*)$')
  end
  return s, tonumber(r), o, tonumber(st), tonumber(f), tn, tonumber(w) or 1
end

-- A queued waiter leaves without being served (timed out, cancelled, owner dead, pushed out).
-- When it was its tenant's last, the tenant's tag falls back to its last served request:
-- requests that were never served leave no debt.
local function unqueue(id, rank, tenant)
  if queue_key(rank) then redis.call('ZREM', queue_key(rank), id) end
  local finish, queued, served = tenant_get(rank, tenant)
  queued = math.max(0, queued - 1)
  if queued == 0 then finish = served end
  tenant_put(rank, tenant, finish, queued, served)
  return queued
end

-- The message says the live replica count too (-1: unknown): a request admitted while the
-- model has no replica must wait for a cold start upstream; an admission ('A') also says the
-- tenant's share (share_of), from which the gateway sets the request's engine priority.
local function wake(owner, token, state, live, tenant, cap)
  local message = token .. '|' .. state .. '|' .. live
  if tenant then
    local held, holders, weights = share_of(tenant)
    message = message .. '|' .. held .. '|' .. holders .. '|' .. weights .. '|' .. cap
  end
  redis.call('PUBLISH', channel .. owner, message)
end

local function token_of(id) return string.match(id, ':(.*)$') end

local function reclaim()
  local expired = redis.call('ZRANGEBYSCORE', LEASES, '-inf', now, 'LIMIT', 0, 256)
  for _, id in ipairs(expired) do
    local rec = redis.call('HGET', WAITERS, id)
    if rec then
      local state, rank, _, _, _, tenant = parse(rec)
      if state == 'Q' then unqueue(id, rank, tenant) end
      redis.call('HDEL', WAITERS, id)
    end
    redis.call('ZREM', LEASES, id)
  end
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', INFLIGHT, '-inf', now)) do
    redis.call('ZREM', INFLIGHT, id)
    unhold(id)
  end
end

-- Which waiter of a tier the next slot goes to: the head (lowest start tag), unless only the
-- reserve is left and the head's tenant holds its share; then the first whose tenant holds less,
-- however deep it waits. A reserve slot handed out of tag order moves the virtual time past the
-- waiters it skipped, so a tenant under its share queues behind every stale waiter of the tenants
-- over theirs: looking at only the first few left the slot idle, and the next release, below the
-- reserve, gave the head (a tenant over its share) a slot. Each tenant's share is read once per
-- call; the walk is bounded by the tier's max_queue_length and runs only while just the reserve is
-- free. A stale id (no record) is returned as is, for the caller to drop.
local PAGE = 64
local function next_waiter(rank, count, cap)
  if not only_reserve_left(count, cap) then
    return redis.call('ZRANGE', queue_key(rank), 0, 0)[1]
  end
  local total = holders_weight(redis.call('HKEYS', HOLDERS))
  local over = {}  -- "<weight>|<tenant>" -> whether it holds its share
  local from = 0
  while true do
    local page = redis.call('ZRANGE', queue_key(rank), from, from + PAGE - 1)
    for _, id in ipairs(page) do
      local rec = redis.call('HGET', WAITERS, id)
      if not rec then return id end
      local _, _, _, _, _, tenant, weight = parse(rec)
      local seen = tag(weight) .. '|' .. tenant
      if over[seen] == nil then over[seen] = over_share(tenant, weight, cap, total) end
      if not over[seen] then return id end
    end
    if #page < PAGE then return nil end
    from = from + PAGE
  end
end

-- Admit waiters, highest tier first and lowest start tag first, while capacity lasts.
local function promote(cap, live)
  local count = redis.call('ZCARD', INFLIGHT)
  while true do
    local rank = nil
    for r = 0, TIERS - 1 do
      if redis.call('ZCARD', queue_key(r)) > 0 then rank = r; break end
    end
    if rank == nil or count >= tier_cap(cap, rank) then break end
    local id = next_waiter(rank, count, cap)
    if id == nil then break end
    redis.call('ZREM', queue_key(rank), id)
    local rec = redis.call('HGET', WAITERS, id)
    if rec then
      local _, _, owner, start, finish, tenant, weight = parse(rec)
      if start > vt_of(rank) then
        redis.call('HSET', STATE, 'vt' .. rank, tag(start))
        keep()
      end
      local tf, queued = tenant_get(rank, tenant)
      tenant_put(rank, tenant, tf, math.max(0, queued - 1), finish)
      redis.call('HDEL', WAITERS, id)
      redis.call('ZREM', LEASES, id)
      hold(id, tenant, weight)
      wake(owner, token_of(id), 'A', live, tenant, cap)
      count = count + 1
    end
  end
  return count
end

local function waiting_ahead(rank, start)
  local ahead = 0
  for r = 0, rank - 1 do ahead = ahead + redis.call('ZCARD', queue_key(r)) end
  return ahead + redis.call('ZCOUNT', queue_key(rank), '-inf', tag(start))
end

local function service_us() return tonumber(redis.call('HGET', STATE, 'svc_us') or '-1') end

-- A free slot for `token` if there is one: {'A', token, 0, cap, live, service, held, holders,
-- weights} (share_of), else nil. Room after promoting means no waiter of this or a higher tier
-- that this slot could go to (any left hold their share and only the reserve is free): admit at
-- once. A token already in flight (a `try` that took the slot but whose answer was lost) is
-- admitted again, without a second slot.
local function take_free(token, rank, tenant, weight, cap, live)
  local count = promote(cap, live)
  if not redis.call('ZSCORE', INFLIGHT, token) then
    if not has_room(count, cap, rank, tenant, weight) then return nil end
    hold(token, tenant, weight)
  end
  local held, holders, weights = share_of(tenant)
  return {'A', token, 0, cap, live, int(service_us()), held, holders, weights}
end

if op == 'try' then
  -- ARGV[8] token, [9] rank, [10] tenant, [11] weight. Admit exactly as `admit` would when a slot is free;
  -- otherwise answer busy ('B') and change nothing else: no place in the queue, no waiter
  -- pushed out, no tenant tag moved. Sent alongside the limiter's admit, before its verdict is
  -- known: the caller releases the slot if the limiter refuses, and queues with `admit` after.
  local token, rank, tenant, weight = ARGV[8], tonumber(ARGV[9]), ARGV[10], tonumber(ARGV[11])
  reclaim()
  local cap, live = capacity()
  return take_free(token, rank, tenant, weight, cap, live) or {'B', '', 0, cap, live, int(service_us())}

elseif op == 'admit' then
  -- ARGV[8] token, [9] rank, [10] tenant, [11] cost / weight, [12] owner, [13] max queue length,
  -- [14] weight
  local token, rank, tenant = ARGV[8], tonumber(ARGV[9]), ARGV[10]
  local size, owner, max_len, weight = tonumber(ARGV[11]), ARGV[12], tonumber(ARGV[13]), tonumber(ARGV[14])
  reclaim()
  local cap, live = capacity()
  local taken = take_free(token, rank, tenant, weight, cap, live)
  if taken then return taken end
  local finish, queued, served = tenant_get(rank, tenant)
  local start = math.max(vt_of(rank), finish)
  local q = queue_key(rank)
  if redis.call('ZCARD', q) >= max_len then
    local last = redis.call('ZRANGE', q, -1, -1, 'WITHSCORES')
    if #last == 0 or tonumber(last[2]) <= start then
      return {'R', '', queued, cap, live, int(service_us()), waiting_ahead(rank, start)}
    end
    -- The queue keeps the waiters fair queuing would admit first: the one furthest ahead in
    -- virtual time (its tenant the most over its share) makes room.
    local victim = last[1]
    local rec = redis.call('HGET', WAITERS, victim)
    if rec then
      local _, vrank, vowner, vstart, vfinish, vtenant, vweight = parse(rec)
      unqueue(victim, vrank, vtenant)
      redis.call('HSET', WAITERS, victim, 'S|' .. vrank .. '|' .. vowner .. '|' .. tag(vstart) .. '|' ..
        tag(vfinish) .. '|w' .. tag(vweight) .. '|' .. vtenant)
      wake(vowner, token_of(victim), 'S', live)
    else
      redis.call('ZREM', q, victim)
    end
    finish, queued, served = tenant_get(rank, tenant)  -- the victim may have been this tenant's
    start = math.max(vt_of(rank), finish)
  end
  local id = string.format('%016d', redis.call('HINCRBY', STATE, 'seq', 1)) .. ':' .. token
  local ahead = waiting_ahead(rank, start)
  local fin = start + size
  redis.call('ZADD', q, tag(start), id)
  redis.call('HSET', WAITERS, id, 'Q|' .. rank .. '|' .. owner .. '|' .. tag(start) .. '|' .. tag(fin) .. '|' ..
    'w' .. tag(weight) .. '|' .. tenant)
  redis.call('ZADD', LEASES, int(now + lease), id)
  tenant_put(rank, tenant, fin, queued + 1, served)
  keep()
  for _, key in ipairs({LEASES, WAITERS, q}) do redis.call('EXPIRE', key, KEEP_S) end
  return {'Q', id, queued, cap, live, int(service_us()), ahead}

elseif op == 'release' then
  -- ARGV[8] slot id, [9] how long it was held (us; negative: unknown)
  local id, held = ARGV[8], tonumber(ARGV[9])
  local removed = redis.call('ZREM', INFLIGHT, id)
  if removed == 1 then unhold(id) end
  if removed == 1 and held >= 0 then
    local svc = service_us()
    if svc < 0 then svc = held else svc = svc + (held - svc) / 8 end
    redis.call('HSET', STATE, 'svc_us', int(svc))
  end
  reclaim()
  promote(capacity())
  return removed

elseif op == 'cancel' then
  -- ARGV[8] waiter id. The waiter gives up (timeout or client gone); it may have been admitted
  -- or pushed out meanwhile, which the answer says.
  local id = ARGV[8]
  if redis.call('ZSCORE', INFLIGHT, id) then return {'A'} end
  local rec = redis.call('HGET', WAITERS, id)
  redis.call('HDEL', WAITERS, id)
  redis.call('ZREM', LEASES, id)
  if not rec then return {'G'} end
  local state, rank, _, start, _, tenant = parse(rec)
  if state == 'S' then return {'S'} end
  local remaining = unqueue(id, rank, tenant)
  local cap, live = capacity()
  return {'C', remaining, cap, live, int(service_us()), waiting_ahead(rank, start)}

elseif op == 'renew' then
  -- ARGV[8..] ids this gateway process holds or waits with: extend their leases, say what each is
  -- (A in flight, Q queued, S pushed out, G gone); the last element is the live replica count.
  local states = {}
  for i = 8, #ARGV do
    local id = ARGV[i]
    if redis.call('ZSCORE', INFLIGHT, id) then
      redis.call('ZADD', INFLIGHT, 'XX', int(now + lease), id)
      states[#states + 1] = 'A'
    else
      local rec = redis.call('HGET', WAITERS, id)
      if not rec then
        states[#states + 1] = 'G'
      elseif string.sub(rec, 1, 1) == 'S' then
        redis.call('HDEL', WAITERS, id)
        redis.call('ZREM', LEASES, id)
        states[#states + 1] = 'S'
      else
        redis.call('ZADD', LEASES, 'XX', int(now + lease), id)
        states[#states + 1] = 'Q'
      end
    end
  end
  reclaim()
  local cap, live = capacity()
  promote(cap, live)
  states[#states + 1] = live
  return states

elseif op == 'replicas' then
  -- ARGV[8] live replica count, [9] seconds it stays valid (a dead publisher's figure expires)
  redis.call('SET', REPLICAS, ARGV[8], 'EX', ARGV[9])
  reclaim()
  promote(capacity())
  return 1

elseif op == 'status' then
  reclaim()
  local cap, live = capacity()
  local count = promote(cap, live)
  local out = {count, cap, live, int(service_us())}
  for r = 0, TIERS - 1 do out[#out + 1] = redis.call('ZCARD', queue_key(r)) end
  return out
end
return redis.error_reply('unknown fair queue op ' .. tostring(op))
