"""Imports every built-in policy module so each registers itself."""

from core.policies import (  # noqa: F401
    ares,
    clairvoyant,
    hyperflexis,
    hyperflexis_scaling,
    least_load,
    lora_affinity,
    oracle,
    prefix_aware,
    prefix_pd,
    queue,
    req_level,
    reschedule,
    round_robin,
    scaling,
    session_affinity,
    sibyl,
    tail_aware,
)
from core.policies.rank import bf_io, engine, fcfs, jsq  # noqa: F401
