"""Request traces: the Trace model, real-trace readers, ServeGen sampling, synthetic workloads, arrivals."""

from core.traces.arrivals import gamma_arrivals, index_of_dispersion, poisson_arrivals
from core.traces.model import Trace
from core.traces.readers import (
    FORMATS,
    detect_format,
    read_azure,
    read_burstgpt,
    read_mooncake,
    read_trace,
)
from core.traces.servegen import read_servegen
from core.traces.synthetic import OUTPUT_CAP, WORKLOADS, synthetic_lengths, synthetic_trace

__all__ = [
    "FORMATS",
    "OUTPUT_CAP",
    "WORKLOADS",
    "Trace",
    "detect_format",
    "gamma_arrivals",
    "index_of_dispersion",
    "poisson_arrivals",
    "read_azure",
    "read_burstgpt",
    "read_mooncake",
    "read_servegen",
    "read_trace",
    "synthetic_lengths",
    "synthetic_trace",
]
