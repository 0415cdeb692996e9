"""The one registry of backends: built-ins and installed packages, found by name through entry points.

A third-party backend is a package that declares an entry point in the group
`sibyl_console.backends` naming a class that implements adapters.backends.base.Backend; it then
shows up in `up --backend NAME`, `doctor` and the dashboard like the built-ins, which register
through the same group (pyproject.toml) and, for a source checkout that was never installed,
through BUILTIN below.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import import_module
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from adapters.backends.base import Backend, Capability
from adapters.backends.settings import BackendSettings
from core.errors import ConfigError

ENTRY_POINT_GROUP = "sibyl_console.backends"

BUILTIN: dict[str, str] = {
    "emulator": "adapters.backends.emulator:EmulatorBackend",
    "sim": "adapters.backends.sim:SimBackend",
    "vllm": "adapters.backends.vllm:VllmBackend",
    "ray": "adapters.ray.backend:RayBackend",
}


@dataclass(frozen=True)
class BackendSpec:
    """One installed backend: its name, where it comes from and what it declares."""

    name: str
    target: str
    """"module:Class" of its implementation."""
    summary: str
    capabilities: frozenset[Capability]
    """Every capability it can declare (some only with certain settings)."""
    error: str | None = None
    """Why it could not be loaded (a broken third-party package is listed, not fatal)."""


def _targets() -> dict[str, str]:
    found = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(ep.name, ep.value)
    return found


def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    return getattr(import_module(module), attr)


def specs() -> list[BackendSpec]:
    """Every backend that is installed, sorted by name."""
    out = []
    for name, target in sorted(_targets().items()):
        try:
            cls = _load(target)
            out.append(BackendSpec(name, target, cls.summary, frozenset(cls.capabilities)))
        except Exception as e:  # a broken plugin must not hide the others
            out.append(BackendSpec(name, target, "", frozenset(), error=f"{type(e).__name__}: {e}"))
    return out


def names() -> list[str]:
    return sorted(_targets())


def create(name: str, settings: BackendSettings, run_dir: Path) -> Backend:
    """Build the backend called `name`; with `settings.attach` the instances are attached instead."""
    targets = _targets()
    if name not in targets:
        raise ConfigError(f"unknown backend {name!r}; installed: {', '.join(sorted(targets))}")
    if settings.attach:
        from adapters.backends.attached import AttachedBackend

        return AttachedBackend(settings, run_dir, label=f"{name}-attached")
    backend: Backend = _load(targets[name])(settings, run_dir)
    return backend
