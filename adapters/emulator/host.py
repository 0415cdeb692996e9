"""What an emulated instance's parts (admin, info, KV legs, migrations) read of the instance: `InstanceHost`."""

from __future__ import annotations

from typing import Protocol

from adapters.emulator.engine import Engine
from adapters.emulator.faults import Faults
from adapters.emulator.lora import EmulatedLora
from adapters.emulator.metrics import EngineMetrics
from adapters.emulator.sequence import Scheduler
from adapters.emulator.settings import InstanceSettings


class InstanceHost(Protocol):
    """The instance as its parts see it: they read it and call its scheduler, never the instance back.

    app.EmulatedInstance implements it and hands itself to each part it builds."""

    @property
    def s(self) -> InstanceSettings:
        """The instance's settings."""
        ...

    @property
    def engine(self) -> Scheduler:
        """Its scheduler: the emulator's own engine, a data-parallel group of them, or another."""
        ...

    @property
    def faults(self) -> Faults: ...

    @property
    def metrics(self) -> EngineMetrics: ...

    @property
    def lora(self) -> EmulatedLora:
        """Its LoRA adapters (inert without --enable-lora)."""
        ...

    @property
    def engine_id(self) -> str:
        """The id it names its KV by in `kv_transfer_params` (vLLM's engine id)."""
        ...

    @property
    def context_len(self) -> int:
        """max_model_len as served (cut to the KV capacity)."""
        ...

    @property
    def created(self) -> int:
        """Unix time it started (the model card's `created`)."""
        ...

    @property
    def in_flight(self) -> int:
        """Generation requests it is serving now."""
        ...

    @property
    def caching(self) -> bool:
        """Whether prefix caching runs (its prompts then carry token ids)."""
        ...

    def engines(self) -> list[Engine]:
        """The engines whose block pools it has (a data-parallel group's ranks; none for other schedulers)."""
        ...
