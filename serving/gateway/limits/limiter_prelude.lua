local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local day = math.floor(tonumber(t[1]) / 86400)
local MINUTE = 60000000
local function num(x) return string.format('%.0f', x) end
-- TATs read or written so far by this script: every write goes through save_tat and the clock
-- stands still inside a script, so a second read of a key needs no second GET.
local tats = {}
local function tat_of(key)
  local tat = tats[key]
  if tat == nil then
    tat = tonumber(redis.call('GET', key) or now)
    if tat < now then tat = now end
    tats[key] = tat
  end
  return tat
end
local function save_tat(key, tat)
  if tat > now then redis.call('SET', key, num(tat), 'PX', num(math.ceil((tat - now) / 1000) + 1000))
  else redis.call('DEL', key) end
  tats[key] = math.max(tat, now)
end
-- Keep the refusal with the longest wait (-1: waiting cannot help, which beats any wait).
local function add_refusal(r, name, w)
  if not r.refused or w < 0 or (r.wait >= 0 and w > r.wait) then r.refused, r.wait = name, w end
end
