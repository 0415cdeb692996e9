"""The discrete-event simulator of a P/D cluster (see engine.py)."""

from core.sim.cluster.cache import CacheParams
from core.sim.cluster.dispatcher import SimDispatcher
from core.sim.cluster.engine import ClusterSimulation
from core.sim.cluster.migration import MigrationEvent
from core.sim.cluster.result import FAIL_REASONS, ClusterSimResult, Mode, ScheduledSwap
from core.sim.cluster.scaling import ScaleEvent

__all__ = [
    "CacheParams",
    "FAIL_REASONS",
    "ClusterSimResult",
    "ClusterSimulation",
    "MigrationEvent",
    "Mode",
    "ScaleEvent",
    "ScheduledSwap",
    "SimDispatcher",
]
