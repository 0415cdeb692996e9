"""The emulated vLLM engine: vLLM 0.32's HTTP API, metrics and P/D protocol, timed by core.perf.

`sibyl-console emulate` (or `python -m adapters.emulator`) serves one or more GPU-free vLLM
stand-ins. Each instance is independent (own engine, metrics registry, KV table, faults); several
run in one process on consecutive ports with `--instances N`.

Modules: engine (continuous batching scheduler), sequence (what it schedules), protocol (request
validation, response / SSE / error shapes), tokens (token counting and generated text), kv (held-KV
leases and the pull side channel), kv_legs (an instance's prefill and decode sides of the handoff),
prefix_cache (the block pool: capacity, LRU, prefix hits, over core.cache), kv_publisher (its KV
events in vLLM's ZMQ format), metrics (vLLM's Prometheus series), faults and admin (fault injection,
/admin/), asgi (raw-ASGI plumbing and the token writers), app (the per-instance ASGI app), info_api
(its read-only endpoints), server (uvicorn), process (start/stop emulator processes), cli (the Typer
command), settings.

Behaviour in brief:
* Tokens: token-id prompts count as their length, text as ceil(UTF-8 bytes / 4), chat as its
  messages' text + 4 per message + 3. Output token i is " t<i>". ignore_eos → exactly
  max_tokens; otherwise a length from --output-len-dist (seeded; per request with `seed`), within
  [min_tokens, max_tokens]. prompt + max_tokens beyond the context is cut (finish "length").
* Timing: a step of B sequences with K resident KV tokens lasts step_time(B, K), plus prefill
  of the chunks it carries (chunked prefill in a token budget), times the slowdown fault; steps
  run back to back on absolute deadlines and a token is written when its step ends.
* P/D: the prefill leg (kv_transfer_params.do_remote_decode) holds its KV blocks under a lease
  and answers vLLM's kv_transfer_params with remote_host/remote_port = its own HTTP address; the
  decode leg pulls them with POST /kv/pull, which takes kv_transfer_time(tokens). vLLM's failure
  modes: nothing listening → 500 after the handshake timeout (or recompute by policy); expired
  blocks, unknown engine or a lost prefill engine → 500 at once; the decode instance stays up.
* Prefix caching (on by default, as in vLLM): full blocks keyed by a hash chain over the prompt's
  token ids; a request reuses its longest cached prefix and prefills the rest; freed blocks stay
  cached, evicted LRU; POST /reset_prefix_cache; --kv-events-config publishes the pool's events.
  On a decode leg, blocks the instance already holds are not pulled again.
* Faults: --fail-rate/--fail-status, --slowdown, --hang, --unhealthy, --exit-after-requests,
  --exit-after-s, and at run time GET/PUT /admin/faults, POST /admin/exit (the whole process
  exits, status 3), GET /admin/info, GET /admin/steps; --admin-token protects /admin/.
"""
