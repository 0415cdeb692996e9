"""Request traces: the Trace model, real-trace readers, ServeGen sampling, synthetic workloads, arrivals,
prompts that keep a trace's prefix structure and sessions derived from it."""

from core.traces.arrivals import gamma_arrivals, index_of_dispersion, poisson_arrivals
from core.traces.model import Trace
from core.traces.prompts import hash_prompt, scaled_length
from core.traces.readers import (
    FORMATS,
    detect_format,
    read_azure,
    read_burstgpt,
    read_mooncake,
    read_trace,
)
from core.traces.servegen import read_servegen
from core.traces.sessions import derive_sessions
from core.traces.synthetic import OUTPUT_CAP, WORKLOADS, synthetic_lengths, synthetic_trace

__all__ = [
    "FORMATS",
    "OUTPUT_CAP",
    "WORKLOADS",
    "Trace",
    "derive_sessions",
    "detect_format",
    "gamma_arrivals",
    "hash_prompt",
    "index_of_dispersion",
    "poisson_arrivals",
    "read_azure",
    "read_burstgpt",
    "read_mooncake",
    "read_servegen",
    "read_trace",
    "scaled_length",
    "synthetic_lengths",
    "synthetic_trace",
]
