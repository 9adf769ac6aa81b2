-- bench/soak.lua: the soak's open-loop traffic (read, list, create, bad_credential) for ONE wrk process.
--
--   wrk -t N -c N -d D --timeout T -s bench/soak.lua URL -- out=PATH start=S seconds=S rate=R threads=N seed=K
--       key=KEY video=ID mix=read:0.6,list:0.15,... expect=read:200,...,bad_credential:401/429 bad=ADDR,ADDR
--       [period=S] [warm=S] [late=S] [shed=1] [internal=TOKEN]
--
-- (bench/soak.py, bench/rollout.py and bench/overload.py run it.) One connection per thread (-t N -c N), so that in each thread request() and response()
-- strictly alternate and the thread knows which request a response answers. wrk calls delay() before every request
-- it sends on a connection that is up, the first one included; after a socket error it reconnects and calls
-- request() at once, without delay() and with no response() for the lost request: request() finding one still
-- outstanding counts it as `no_response`. Thread 0's request() is also called once before the run, to check the
-- request's syntax: calls before the first delay() are not part of the schedule.
--
-- The schedule is open (as wrk2's, against coordinated omission): thread i of N sends its k-th request at
-- start + (i + k*N) / rate; together the threads offer `rate` requests/s, evenly spaced. delay() waits for the next
-- one's due time (0 if it is past), and a request's latency is its response's time minus its *scheduled* time (or
-- its send time, if that was earlier: delay() has whole ms), so a stall counts fully, also for the requests that
-- waited behind it. Times are CLOCK_MONOTONIC (via ffi), the clock of Python's time.monotonic(), so `start` is
-- shared with the Python client. Nothing is scheduled at or after start + seconds; wrk's -d leaves a grace for the
-- last answers, after which any still outstanding count as `no_response`; a thread whose schedule is over and
-- answered stops. Each request's kind is drawn by a seeded random (seed + thread) with the mix's shares, normalised
-- over wrk's kinds. Kinds: read, list, create, bad_credential (from the `bad` addresses, as a trusted proxy sends
-- them), and internal (GET /internal/v1/videos/ID with Weir's internal token, `internal=TOKEN`).
--
-- bench/overload.py's options: `warm=S`: the schedule's first S seconds are a warm-up, sent and not counted (the
-- periods start after it); `late=S`: a request whose connection is free only more than S seconds after its time
-- is not sent, and counts as `unsent` (an overloaded stack otherwise leaves the client an ever longer backlog);
-- `shed=1`: each kind K has a pseudo-kind "K:shed" counting its 503 answers whose problem code is `overloaded`
-- (status {"503": n}) with their latencies (hist), whatever K expects, and "K:shed_sent" the same answers'
-- latencies from when each was sent (the server's refusal time, without the wait behind an earlier request on the
-- connection that the scheduled time counts).
--
-- Per kind and minute (of the scheduled time; `period=S` makes them S seconds long, bench/rollout.py's 1): the
-- count of each status, and the latencies of the expected ones in a log-linear histogram (1 us buckets below
-- 128 us, then 64 per power of two: each <= 1.6 % wide). The counters are a C array per thread (ffi): wrk's
-- thread:get copies only flat values correctly (a nested table loses its place: PANIC "invalid key to 'next'"), so
-- done() reads each thread's array through its address, a number. done() sums the
-- threads and writes one JSON document to `out`: {"start", "seconds", "rate", "threads", "minutes": [{kind:
-- {"hist": {"<midpoint us>": count}, "status": {"<code>": count}, "no_response": n, "unsent": n}}], "wrk_errors":
-- {connect, read, write, timeout, status}, "wrk_requests"}.

local ffi = require("ffi")
ffi.cdef[[
struct weir_timespec { long tv_sec; long tv_nsec; };
int clock_gettime(int clk_id, struct weir_timespec *tp);
]]
local CLOCK_MONOTONIC = 1
local ts = ffi.new("struct weir_timespec")

-- microseconds on the clock Python's time.monotonic() reads
local function now_us()
   ffi.C.clock_gettime(CLOCK_MONOTONIC, ts)
   return tonumber(ts.tv_sec) * 1000000 + tonumber(ts.tv_nsec) / 1000
end

-- ---------------------------------------------------------------- histogram buckets

local SUB = 64          -- sub-buckets per power of two
local BUCKETS = 1344    -- up to 2^26 us (67 s); the last bucket takes anything longer
local STATUSES = 600    -- a slot per status code 0..599 (anything else in slot 0)
local NO_RESPONSE, UNSENT = BUCKETS + STATUSES, BUCKETS + STATUSES + 1
local BLOCK = BUCKETS + STATUSES + 2  -- per (minute, kind): buckets, statuses, no_response, unsent
local OVERLOADED = '"code"%s*:%s*"overloaded"'  -- a shed answer's problem code (shared/problems.py)

local function bucket(us)
   local v = math.floor(us)
   if v < 2 * SUB then
      return v < 0 and 0 or v
   end
   local e = math.floor(math.log(v) / math.log(2))
   while 2 ^ e > v do e = e - 1 end      -- log's rounding at exact powers of two
   while 2 ^ (e + 1) <= v do e = e + 1 end
   local m = math.floor(v / 2 ^ (e - 6))  -- 64 .. 127
   local index = 2 * SUB + (e - 7) * SUB + (m - SUB)
   return index < BUCKETS and index or BUCKETS - 1
end

-- the middle of a bucket, in us
local function midpoint(index)
   if index < 2 * SUB then
      return index
   end
   local e = math.floor((index - 2 * SUB) / SUB) + 7
   local m = (index - 2 * SUB) % SUB + SUB
   local width = 2 ^ (e - 6)
   return m * width + (width - 1) / 2
end

local function split(text, sep)
   local out = {}
   for part in string.gmatch(text, "([^" .. sep .. "]+)") do
      out[#out + 1] = part
   end
   return out
end

-- ---------------------------------------------------------------- a thread's state (globals: thread:get reads them)

local cfg = {}
local kinds, cumulative, requests, expected, bad_requests = {}, {}, {}, {}, {}
local started, next_due, interval, start_us, end_us, bad_next, period_us = false, 0, 0, 0, 0, 0, 60000000
local count_from_us, late_us, n_drawn = 0, math.huge, 0  -- warm=, late=; n_drawn: the mix's kinds (before :shed)
local shed_of, shed_sent_of = {}, {}  -- kind's index -> its pseudo-kinds' indexes (shed=1)
local counts  -- uint32_t[n_minutes * #kinds * BLOCK]
-- the request in flight: kind's index (0: none), minute (1-based) and scheduled time
local out_kind, out_minute, out_scheduled, out_sent = 0, 0, 0, 0

local function slot(minute, kind, offset)
   return ((minute - 1) * #kinds + (kind - 1)) * BLOCK + offset
end

function setup(thread)
   threads = threads or {}
   thread:set("id", #threads)
   threads[#threads + 1] = thread
end

function init(args)
   for _, arg in pairs(args) do
      local k, v = string.match(arg, "^([%w_]+)=(.*)$")
      if k then cfg[k] = v end
   end
   for _, name in ipairs({"out", "start", "seconds", "rate", "threads", "seed", "key", "video", "mix", "expect",
                          "bad"}) do
      assert(cfg[name], "soak.lua needs " .. name .. "=")
   end
   local total = 0
   for _, pair in ipairs(split(cfg.mix, ",")) do
      local kind, share = string.match(pair, "^([%w_]+):([%d.]+)$")
      kinds[#kinds + 1] = kind
      total = total + tonumber(share)
      cumulative[#cumulative + 1] = total
   end
   for i = 1, #cumulative do cumulative[i] = cumulative[i] / total end  -- normalised over wrk's kinds
   cumulative[#cumulative] = 1
   n_drawn = #kinds
   if cfg.shed == "1" then
      for k = 1, n_drawn do
         kinds[#kinds + 1] = kinds[k] .. ":shed"
         shed_of[k] = #kinds
      end
      for k = 1, n_drawn do
         kinds[#kinds + 1] = kinds[k] .. ":shed_sent"
         shed_sent_of[k] = #kinds
      end
   end
   for _, pair in ipairs(split(cfg.expect, ",")) do
      local kind, codes = string.match(pair, "^([%w_]+):(.+)$")
      expected[kind] = {}
      for _, code in ipairs(split(codes, "/")) do expected[kind][tonumber(code)] = true end
   end

   local host = wrk.headers["Host"]
   local function headers(extra)
      local h = {["Host"] = host, ["Authorization"] = "Bearer " .. cfg.key}
      for k, v in pairs(extra or {}) do h[k] = v end
      return h
   end
   requests.read = wrk.format("GET", "/v1/videos/" .. cfg.video, headers())
   requests.list = wrk.format("GET", "/v1/videos?limit=20", headers())
   requests.create = wrk.format("POST", "/v1/videos", headers({["Content-Type"] = "application/json"}),
                                '{"name":"soak"}')
   for _, address in ipairs(split(cfg.bad, ",")) do
      bad_requests[#bad_requests + 1] = wrk.format("GET", "/v1/videos", headers({
         ["Authorization"] = "Bearer wsk_" .. string.rep("0", 32), ["X-Forwarded-For"] = address}))
   end
   if cfg.internal then
      requests.internal = wrk.format("GET", "/internal/v1/videos/" .. cfg.video,
                                     {["Host"] = host, ["X-Weir-Internal-Token"] = cfg.internal})
   end
   for k = 1, n_drawn do
      local kind = kinds[k]
      assert(requests[kind] or (kind == "bad_credential" and #bad_requests > 0), "soak.lua: no request for " .. kind)
      assert(expected[kind], "soak.lua: no expected statuses for " .. kind)
   end

   local rate = tonumber(cfg.rate)
   start_us = tonumber(cfg.start) * 1000000
   end_us = start_us + tonumber(cfg.seconds) * 1000000
   interval = tonumber(cfg.threads) * 1000000 / rate
   next_due = start_us + id * 1000000 / rate
   math.randomseed(tonumber(cfg.seed) + id)
   bad_next = id

   period_us = tonumber(cfg.period or "60") * 1000000
   count_from_us = start_us + tonumber(cfg.warm or "0") * 1000000
   late_us = cfg.late and tonumber(cfg.late) * 1000000 or math.huge
   n_minutes = math.max(1, math.ceil((end_us - count_from_us) / period_us))
   n_kinds = #kinds
   kind_names = table.concat(kinds, ",")
   out_path = cfg.out
   start_s, seconds_s, rate_s = tonumber(cfg.start), tonumber(cfg.seconds), rate
   counts = ffi.new("uint32_t[?]", n_minutes * #kinds * BLOCK)  -- zeroed; kept alive by this upvalue
   counts_addr = tonumber(ffi.cast("uintptr_t", counts))
end

-- the next request's kind, drawn from the mix
local function draw()
   local r, k = math.random(), n_drawn
   for i = 1, n_drawn do
      if r < cumulative[i] then k = i break end
   end
   return k
end

-- the counting period of a request due at `due` (0: the warm-up, not counted)
local function period_of(due)
   if due < count_from_us then return 0 end
   return math.floor((due - count_from_us) / period_us) + 1
end

function delay()
   started = true
   local now = now_us()
   while next_due < end_us and now - next_due > late_us do  -- too late to send: counted as unsent
      local k, minute = draw(), period_of(next_due)
      if minute > 0 then
         local i = slot(minute, k, UNSENT)
         counts[i] = counts[i] + 1
      end
      next_due = next_due + interval
   end
   if next_due >= end_us then
      -- the schedule is over and its last request answered: stop this thread's loop, so that its connection sits
      -- unread until wrk's -d ends (an idle connection that the server closes would be a read error)
      wrk.thread:stop()
      return 3600 * 1000
   end
   local wait = (next_due - now) / 1000
   return wait > 0 and math.floor(wait) or 0
end

function request()
   if not started or next_due >= end_us then
      -- wrk's syntax check before the run, or a reconnect after the schedule's end: not part of the schedule
      return requests.read
   end
   if out_kind ~= 0 and out_minute > 0 then  -- the previous request was lost to a socket error
      local i = slot(out_minute, out_kind, NO_RESPONSE)
      counts[i] = counts[i] + 1
   end
   local k = draw()
   -- delay() is whole ms (wrk's timers), so a request may go up to 1 ms before its time: it is measured from when
   -- it went, and one that went late from when it was due
   local now = now_us()
   out_kind, out_scheduled, out_sent = k, next_due > now and now or next_due, now
   out_minute = period_of(next_due)
   outstanding_kind, outstanding_minute = out_kind, out_minute  -- for done()
   next_due = next_due + interval
   local kind = kinds[k]
   if kind == "bad_credential" then
      bad_next = bad_next % #bad_requests + 1
      return bad_requests[bad_next]
   end
   return requests[kind]
end

function response(status, headers, body)
   if out_kind == 0 then return end
   local k = out_kind
   out_kind, outstanding_kind = 0, 0
   if out_minute == 0 then return end  -- the warm-up's
   local s = (status >= 0 and status < STATUSES) and status or 0
   local i = slot(out_minute, k, BUCKETS + s)
   counts[i] = counts[i] + 1
   local hist_kind = expected[kinds[k]][status] and k or nil
   if status == 503 and shed_of[k] and body and string.find(body, OVERLOADED) then
      hist_kind = shed_of[k]
      i = slot(out_minute, hist_kind, BUCKETS + s)
      counts[i] = counts[i] + 1
      local from_sent = now_us() - out_sent
      i = slot(out_minute, shed_sent_of[k], bucket(from_sent > 0 and from_sent or 0))
      counts[i] = counts[i] + 1
   end
   if hist_kind then
      local latency = now_us() - out_scheduled
      i = slot(out_minute, hist_kind, bucket(latency > 0 and latency or 0))
      counts[i] = counts[i] + 1
   end
end

-- ---------------------------------------------------------------- done (the main state): sum, write JSON

local function encode(v)
   local t = type(v)
   if t == "number" then
      if v ~= v or v == math.huge or v == -math.huge then return "null" end
      if v == math.floor(v) and math.abs(v) < 1e15 then return string.format("%d", v) end
      return string.format("%.6f", v)
   elseif t == "string" then
      return '"' .. v:gsub('[%c"\\]', function(ch) return string.format("\\u%04x", string.byte(ch)) end) .. '"'
   elseif t == "boolean" then
      return tostring(v)
   elseif t == "nil" then
      return "null"
   end
   -- a table: an array when its keys are exactly 1..#v (and it is not empty), else an object
   local n = #v
   local is_array = n > 0
   for k in pairs(v) do
      if type(k) ~= "number" or k < 1 or k > n or k ~= math.floor(k) then is_array = false break end
   end
   local parts = {}
   if is_array then
      for i = 1, n do parts[i] = encode(v[i]) end
      return "[" .. table.concat(parts, ",") .. "]"
   end
   for k, val in pairs(v) do
      parts[#parts + 1] = encode(type(k) == "number" and string.format("%d", k) or tostring(k)) .. ":" .. encode(val)
   end
   return "{" .. table.concat(parts, ",") .. "}"
end

function done(summary, latency, reqs)
   local first = threads[1]
   local names = split(first:get("kind_names"), ",")
   local n_min, n_k = first:get("n_minutes"), first:get("n_kinds")
   local sums = {}
   for i = 0, n_min * n_k * BLOCK - 1 do sums[i] = 0 end
   for _, thread in ipairs(threads) do
      local p = ffi.cast("uint32_t *", ffi.cast("uintptr_t", thread:get("counts_addr")))
      for i = 0, n_min * n_k * BLOCK - 1 do
         if p[i] ~= 0 then sums[i] = sums[i] + p[i] end
      end
      local k, minute = thread:get("outstanding_kind"), thread:get("outstanding_minute")
      if k and k ~= 0 and minute > 0 then  -- sent, never answered before wrk stopped
         local i = ((minute - 1) * n_k + (k - 1)) * BLOCK + NO_RESPONSE
         sums[i] = sums[i] + 1
      end
   end
   local minutes = {}
   for m = 1, n_min do
      local row = {}
      for k = 1, n_k do
         local base = ((m - 1) * n_k + (k - 1)) * BLOCK
         local hist, status = {}, {}
         for b = 0, BUCKETS - 1 do
            if sums[base + b] > 0 then hist[string.format("%.1f", midpoint(b))] = sums[base + b] end
         end
         for s = 0, STATUSES - 1 do
            if sums[base + BUCKETS + s] > 0 then status[tostring(s)] = sums[base + BUCKETS + s] end
         end
         row[names[k]] = {hist = hist, status = status, no_response = sums[base + NO_RESPONSE],
                          unsent = sums[base + UNSENT]}
      end
      minutes[m] = row
   end
   local doc = {
      start = tonumber(first:get("start_s")), seconds = first:get("seconds_s"), rate = first:get("rate_s"),
      threads = #threads, minutes = minutes, wrk_errors = summary.errors, wrk_requests = summary.requests,
   }
   local f = assert(io.open(first:get("out_path"), "w"))
   f:write(encode(doc))
   f:close()
end
