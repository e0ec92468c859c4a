-- wrk script for bench/loadgen_wrk.py: POSTs the bodies of BODIES_FILE (one JSON body per
-- line) in turn, with the headers bench/loadgen.py sends, and writes WRK_OUT as JSON when done:
-- requests, duration_us, errors by kind (non-2xx/3xx answers are wrk's "status" errors), and
-- the latency histogram as [value_us, count] pairs (wrk's stats object: #latency distinct
-- values, latency(i) = i-th value and its count; wrk 4 SCRIPTING, src/script.c).
local path = os.getenv("WRK_PATH")
local requests_, n, i = {}, 0, 0
for line in io.lines(os.getenv("BODIES_FILE")) do
  if #line > 0 then
    n = n + 1
    requests_[n] = wrk.format("POST", path, {["Content-Type"] = "application/json",
                                             ["Authorization"] = "Bearer bench"}, line)
  end
end

request = function()
  i = i % n + 1
  return requests_[i]
end

done = function(summary, latency, requests)
  local e = summary.errors
  local pairs_ = {}
  for k = 1, #latency do
    local value, count = latency(k)
    pairs_[k] = string.format("[%d,%d]", value, count)
  end
  local f = assert(io.open(os.getenv("WRK_OUT"), "w"))
  f:write(string.format('{"requests":%d,"duration_us":%d,"errors":{"connect":%d,"read":%d,"write":%d,' ..
                        '"status":%d,"timeout":%d},"latency_us":[%s]}\n', summary.requests, summary.duration,
                        e.connect, e.read, e.write, e.status, e.timeout, table.concat(pairs_, ",")))
  f:close()
end
