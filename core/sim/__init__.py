"""The discrete-event simulator of a P/D cluster."""

from core.sim.engine import Mode, ScheduledSwap, SimResult, Simulation

__all__ = ["Mode", "ScheduledSwap", "SimResult", "Simulation"]
