"""The auth service's decisions, pure: no I/O and no clock (what depends on time takes `now`, seconds since the epoch).

One check, as `services.auth.checker` wires it: `credentials.read_credentials` -> one lookup -> `access.RequestFacts`
-> `limits.plan_counts` -> `memory.refusal_from_memory`, else the counter store counts the plan -> `limits.decide`
-> `memory` remembers what it spent and the secret key it accepted.
"""
