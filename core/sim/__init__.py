"""Every simulator of the project, each in its own subpackage with its own names.

- `core.sim.cluster`: the discrete-event simulator of a P/D cluster driving the same dispatcher
  as live (`ClusterSimulation` → `ClusterSimResult`; decode models, migration and scaling).
- `core.sim.instance`: the iteration-level scheduler simulator of ONE vLLM-like instance and the
  request orderings it runs (`InstanceSim`, `simulate_instance` → `InstanceSimResult`).
- `core.sim.dp`: data-parallel decode groups (ranks meeting at a barrier every step) and a step
  simulator of one group under a rank policy of core/policies/rank/ (`simulate_dp` → `DPSimResult`).

The simulators consume the policies and the dispatcher; nothing in core/policies, core/dispatch or
core/cache imports them (an import-linter contract says so). Nothing is imported here, so importing
one simulator does not load the others.
"""
