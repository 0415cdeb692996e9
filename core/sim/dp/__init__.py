"""Data-parallel decode groups (ranks meeting at a barrier every step) and BF-IO rank assignment.

`model` holds the group, its step-time and imbalance metrics and the IO objective; `assign` the
rank-assignment policies (fcfs, jsq, bf_io; `FcfsAssign`, `Jsq`, `BfIo`), with BF-IO's lookahead
in `lookahead`; `oracle` the exact integer program for one round; `engine` a seeded step
simulator of one group (`simulate_dp` → `DPSimResult`). See shared/design/papers/bf-io.md.
"""
