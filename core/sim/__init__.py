"""Every simulator of the project, each in its own subpackage with its own names.

- `core.sim.cluster`: the discrete-event simulator of a P/D cluster driving the same dispatcher
  as live (`ClusterSimulation` → `ClusterSimResult`; decode models, migration and scaling).
- `core.sim.instance`: the iteration-level scheduler simulator of ONE vLLM-like instance and the
  request orderings it runs (`InstanceSim`, `simulate_instance` → `InstanceSimResult`).
- `core.sim.dp`: data-parallel decode groups (ranks meeting at a barrier every step), their
  rank-assignment policies and a step simulator of one group (`simulate_dp` → `DPSimResult`).

Nothing is imported here, so importing one simulator (e.g. the DP assignment policies, which
core.dispatch uses) does not load the others.
"""
