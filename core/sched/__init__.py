"""Per-instance request scheduling: an iteration-level simulator of one vLLM-like instance and the
orderings it can run (FCFS, SJF and SRPT with perfect or predicted lengths, tail-aware γ-Boost).

`core.sched.instance` is the engine (continuous batching, token budget with chunked prefill, paged
KV with preemption by recompute); `core.sched.orderings` holds the pluggable priority orders, the
γ-Boost function, MemGuard binning and the γ-Ada estimator (shared/design/papers/tail-aware.md).
"""
