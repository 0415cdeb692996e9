"""Where the benchmarks find things: the repository root and the shared traces folder."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The repository root."""

TRACES_ENV = "SIBYL_TRACES"
"""Environment variable naming the traces folder."""

DEFAULT_TRACES = ROOT.parent / "shared" / "traces"
"""The traces folder when neither --traces nor SIBYL_TRACES names one: ../shared/traces beside the
repository (shared/traces/README.md describes its files)."""


def traces_dir(cli: str | Path | None = None) -> Path:
    """The traces folder: `cli` (a --traces option) if given, else $SIBYL_TRACES, else
    ../shared/traces relative to the repository."""
    if cli:
        return Path(cli).expanduser()
    env = os.environ.get(TRACES_ENV, "").strip()
    if env:
        return Path(env).expanduser()
    return DEFAULT_TRACES


def add_traces_option(ap: argparse.ArgumentParser) -> None:
    """Add `--traces DIR` (read back with `traces_dir(args.traces)`)."""
    ap.add_argument(
        "--traces",
        type=Path,
        default=None,
        help=f"the traces folder (default: ${TRACES_ENV}, else {DEFAULT_TRACES})",
    )


AZURE_CONV = Path("azure_llm_2023") / "AzureLLMInferenceTrace_conv.csv"
"""The Azure 2023 conversation trace, relative to the traces folder."""
SERVEGEN_R1 = Path("servegen_deepseek_r1")
"""ServeGen's DeepSeek-R1 reasoning distributions, relative to the traces folder."""
BURSTGPT_SAMPLE = Path("burstgpt_sample") / "burst_data_8000.json"
"""The BF-IO authors' 8,000-row BurstGPT length sample, relative to the traces folder."""
