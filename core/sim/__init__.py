"""The discrete-event simulator of a P/D cluster."""

from core.sim.engine import FAIL_REASONS, Mode, ScheduledSwap, SimResult, Simulation
from core.sim.scaling import ScaleEvent

__all__ = ["FAIL_REASONS", "Mode", "ScaleEvent", "ScheduledSwap", "SimResult", "Simulation"]
