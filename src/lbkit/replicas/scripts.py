"""The Lua scripts of :class:`lbkit.replicas.RedisStore` (commands common to Redis >= 6.2 and
Valkey; scripts replicate by effects, the default since Redis 5, so ``TIME`` may precede
writes).

Tables are strings of big-endian signed 64-bit fields (``BITFIELD ... i64 #i``): field ``i``
at bytes ``8 i .. 8 i + 7``, so a view is one ``GET`` and parses with one ``numpy.frombuffer``
(a hash of decimal strings costs a field-by-field walk on both ends). Lua holds numbers as
doubles: the sums are exact below ``2**53``.

Keys of a table (``KIND``: ``decode`` or ``prefill``), in the order the scripts take them:

1. ``tot``: the totals over replicas;
2. ``c:REPLICA``: this replica's contribution (same fields);
3. ``ver``: hash, replica to the version of its last applied publish (``-2``: reaped);
4. ``replicas``: set of the replicas holding a contribution;
5. ``seen``: hash, replica to the server's time of its last heartbeat, ms (a call sends one
   when ``HEARTBEAT_S`` or more have passed since its last: the heartbeat is at most that much
   older than the replica's last call);
6. ``seq``: counter of the changes of the totals (one per applied publish or reap);
7. ``ch``: the channel on which each change is announced (``SEQ|REPLICA|f,d,f,d...``: the
   totals' fields ``f`` moved by ``d``), for replicas that mirror the totals.
"""

from __future__ import annotations

__all__ = ["ACQUIRE", "REAP", "RELEASE", "SNAP", "SYNC", "TABLE_PARTS", "WRITE_FENCED"]

#: Key suffixes of a table, in the order of the scripts' ``KEYS`` (``c:`` takes the replica).
TABLE_PARTS = ("tot", "c:", "ver", "replicas", "seen", "seq", "ch")

# Shared by SYNC and REAP: move the totals by the change of one contribution, announce it.
# ``fv`` holds field, new value pairs from index i0; chunks keep BITFIELD's arguments far below
# Lua's stack limit (8,000).
_APPLY = """
local function apply(c, fv, i0, rid)
  local msg = {}
  local i = i0
  while i <= #fv do
    local last = math.min(#fv, i + 1999)
    local set = {}
    for j = i, last, 2 do
      set[#set + 1] = 'SET'; set[#set + 1] = 'i64'; set[#set + 1] = '#' .. fv[j]
      set[#set + 1] = fv[j + 1]
    end
    local old = redis.call('BITFIELD', c, unpack(set))
    local inc = {}
    for k = 1, #old do
      local j = i + 2 * (k - 1)
      local d = tonumber(fv[j + 1]) - old[k]
      if d ~= 0 then
        local ds = string.format('%.0f', d)
        inc[#inc + 1] = 'INCRBY'; inc[#inc + 1] = 'i64'; inc[#inc + 1] = '#' .. fv[j]
        inc[#inc + 1] = ds
        msg[#msg + 1] = fv[j]; msg[#msg + 1] = ds
      end
    end
    if #inc > 0 then redis.call('BITFIELD', KEYS[1], unpack(inc)) end
    i = last + 1
  end
  local seq = redis.call('INCR', KEYS[6])
  redis.call('PUBLISH', KEYS[7], seq .. '|' .. rid .. '|' .. table.concat(msg, ','))
end
"""

#: Publish (when the version allows) and view, atomically. ARGV: replica, version, size,
#: flags (the sum of ``1``: a whole publish, and ``2``: a heartbeat), then field, value pairs.
#: A whole publish applies over any older version (a reaped or lost replica rejoins); a partial
#: one only on top of the replica's publish of version - 1 (the store holds exactly what the
#: replica last sent). A heartbeat records the server's time as the replica's last call.
#: Returns the stored version (an integer) when size is 0, else one string: the stored version
#: in decimal, ``|``, then the totals (one bulk reply: the cheapest for a client to read).
SYNC = (
    _APPLY
    + """
local rid = ARGV[1]
local flags = tonumber(ARGV[4])
local whole = flags % 2 == 1
local cur = redis.call('HGET', KEYS[3], rid) or '-1'
local ver = tonumber(ARGV[2])
local c = tonumber(cur)
if ver >= 0 and ((whole and ver > c) or (not whole and c >= 0 and c == ver - 1)) then
  local fv = {}
  for i = 5, #ARGV do fv[i - 4] = ARGV[i] end
  apply(KEYS[2], fv, 1, rid)
  redis.call('HSET', KEYS[3], rid, ARGV[2])
  if whole then redis.call('SADD', KEYS[4], rid) end
  cur = ARGV[2]
end
if flags >= 2 then
  local t0 = redis.call('TIME')
  redis.call('HSET', KEYS[5], rid, tonumber(t0[1]) * 1000 + math.floor(tonumber(t0[2]) / 1000))
end
if tonumber(ARGV[3]) == 0 then return tonumber(cur) end
return cur .. '|' .. (redis.call('GET', KEYS[1]) or '')
"""
)

#: A mirror's starting point, atomically: ``{seq, totals, contribution of each replica in
#: ARGV}`` (KEYS: tot, seq, then ``c:REPLICA`` of each).
SNAP = """
local out = {redis.call('GET', KEYS[2]) or '0', redis.call('GET', KEYS[1]) or ''}
for i = 3, #KEYS do out[#out + 1] = redis.call('GET', KEYS[i]) or '' end
return out
"""

#: Take out the contribution of replica ARGV[1] if its last call is ARGV[2] ms old or older.
REAP = (
    _APPLY
    + """
local t0 = redis.call('TIME')
local ms = tonumber(t0[1]) * 1000 + math.floor(tonumber(t0[2]) / 1000)
local rid = ARGV[1]
local last = tonumber(redis.call('HGET', KEYS[5], rid) or '-1')
if last < 0 or ms - last < tonumber(ARGV[2]) then return 0 end
local n = math.floor(redis.call('STRLEN', KEYS[2]) / 8)
local fv = {}
for i = 0, n - 1 do fv[#fv + 1] = tostring(i); fv[#fv + 1] = '0' end
apply(KEYS[2], fv, 1, rid)
redis.call('DEL', KEYS[2])
redis.call('SREM', KEYS[4], rid)
redis.call('HSET', KEYS[3], rid, '-2')
redis.call('HDEL', KEYS[5], rid)
return 1
"""
)

#: Take or renew lease KEYS[1] (value ``REPLICA:EPOCH``) for ARGV[2] ms; a new grant takes a
#: new epoch from KEYS[2]. Returns the epoch, or -1 when another replica holds the lease.
ACQUIRE = """
local cur = redis.call('GET', KEYS[1])
if cur then
  local holder, epoch = string.match(cur, '^(.*):(%d+)$')
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return tonumber(epoch)
  end
  return -1
end
local epoch = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. epoch, 'NX', 'PX', ARGV[2])
return epoch
"""

RELEASE = """
local cur = redis.call('GET', KEYS[1])
if cur and cur == ARGV[1] .. ':' .. ARGV[2] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
"""

#: Write payload ARGV[2] to hash KEYS[2] under the fencing epoch ARGV[1] if it is the latest
#: granted (counter KEYS[1]); the payload's new version, or -1 (a newer leader exists).
WRITE_FENCED = """
if tonumber(redis.call('GET', KEYS[1]) or '0') ~= tonumber(ARGV[1]) then return -1 end
local version = redis.call('HINCRBY', KEYS[2], 'version', 1)
redis.call('HSET', KEYS[2], 'epoch', ARGV[1], 'payload', ARGV[2])
return version
"""
