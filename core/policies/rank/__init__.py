"""Rank policies (kind `rank`): which data-parallel rank of a decode instance a request runs on.

A decode instance may be a data-parallel group of G ranks that step together, each step as long
as its most loaded rank's (BF-IO, shared/design/papers/bf-io.md). Live, the rank is chosen when a
request's decode leg is sent (vLLM's `X-data-parallel-rank` header), from the dispatcher's own
record of what each rank holds, as a one-request admission round; the DP simulator
(core/sim/dp/engine.py) runs the same classes over whole rounds.

`state` holds the group's snapshot and the IO objective, `lookahead` BF-IO's H > 0 projection,
`base` the policy bases, and one module per policy: `engine` (no rank sent: the group's own
balancer decides, vLLM's default), `fcfs`, `jsq` and `bf_io`.
"""
