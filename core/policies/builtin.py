"""Imports every built-in policy module so each registers itself."""

from core.policies import least_load, req_level, round_robin, sibyl  # noqa: F401
