"""Data-parallel decode groups (ranks meeting at a barrier every step) under a rank policy.

`model` holds the group, its step time and imbalance, idle and energy metrics; `oracle` the exact
integer program for one round (to score heuristics); `engine` a seeded step simulator of one group
(`simulate_dp` → `DPSimResult`). The rank policies it runs (fcfs, jsq, bf_io), the group's snapshot
and the IO objective are the live ones, in core/policies/rank/. See shared/design/papers/bf-io.md.
"""
