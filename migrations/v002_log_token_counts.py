"""v2: lifetime logs are capped by tokens, not entries, so each log gets a token counter.

Requests vary from tens to tens of thousands of tokens, so an entry cap bounds neither memory
nor what a replica loads into its fixed-size lifetime buffer. From v2 the append script keeps
``draftcache:v1:ns:{<ns>}:log:tokens`` equal to the sum of the log's ``n`` fields and trims by
it; it refuses to append to a log without one. This step creates the counter for every log
written under v1 by summing its entries. Re-running it recomputes the same sums.
"""

from __future__ import annotations

from migrations import keys
from migrations.base import Migration
from migrations.clients import Client

# KEYS[1] stream, KEYS[2] counter. One script per log, so no append lands between sum and set.
_RECOUNT_LUA = """
local total, last = 0, nil
while true do
  local batch = redis.call('XRANGE', KEYS[1], last and ('(' .. last) or '-', '+', 'COUNT', 1024)
  if #batch == 0 then break end
  for _, entry in ipairs(batch) do
    local fields, n = entry[2], nil
    for j = 1, #fields, 2 do
      if fields[j] == 'n' then n = tonumber(fields[j + 1]) end
    end
    if not n then return redis.error_reply('CORRUPT log entry ' .. entry[1] .. ' has no token count') end
    total = total + n
    last = entry[1]
  end
end
redis.call('SET', KEYS[2], string.format('%d', total))
return total
"""


def apply(client: Client) -> None:
    recount = client.register_script(_RECOUNT_LUA)
    for key in client.scan_iter(match=keys.V1_LOG_PATTERN, count=1000, _type="stream"):
        ns = keys.tag_of(key)
        recount(keys=[keys.v1_log(ns), keys.v1_log_tokens(ns)])


MIGRATION = Migration(version=2, description="token counters for lifetime logs (cap by tokens)", apply=apply)
