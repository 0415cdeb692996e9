"""Per-instance request scheduling: an iteration-level simulator of one vLLM-like instance and the
orderings it can run (FCFS, SJF and SRPT with perfect or predicted lengths, tail-aware γ-Boost).

`engine` is the simulator (`InstanceSim`, `simulate_instance`: continuous batching, token budget
with chunked prefill, paged KV with preemption by recompute); `model` its vocabulary (request
states, `Ordering`, `InstanceParams`, `InstanceSimResult`); `orderings` the pluggable priority
orders, built from the γ-Boost function, MemGuard binning and the γ-Ada estimator of
core/policies/gamma.py (shared/design/papers/tail-aware.md).
"""
