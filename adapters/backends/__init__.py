"""Everything that runs instances: one Backend protocol, its capabilities, and a registry of backends."""

from adapters.backends.base import Backend, BackendBase, Capability, require
from adapters.backends.registry import BackendSpec, create, names, specs
from adapters.backends.settings import BackendSettings, EmulatorSettings, VllmSettings

__all__ = [
    "Backend",
    "BackendBase",
    "BackendSettings",
    "BackendSpec",
    "Capability",
    "EmulatorSettings",
    "VllmSettings",
    "create",
    "names",
    "require",
    "specs",
]
