"""LoRA on one emulated vLLM 0.32 instance: its flags, /v1/load_lora_adapter and /v1/unload_lora_adapter with
vLLM's shapes and errors, adapter slots with LRU eviction and load time, the per-step cost of active adapters,
`vllm:lora_requests_info`, and the adapters' cards in /v1/models.

vLLM's behaviour mirrored (0.32: `entrypoints/serve/lora/`, `entrypoints/openai/models/serving.py`,
`lora/worker_manager.py`, `v1/metrics/loggers.py`):

* `--enable-lora`, `--max-loras` (adapters one batch may run, default 1), `--max-lora-rank` (default
  16), `--max-cpu-loras` (adapters the instance keeps, LRU; default `--max-loras`).
* The load/unload routes exist only with `VLLM_ALLOW_RUNTIME_LORA_UPDATING` set (otherwise 404
  `{"detail": "Not Found"}`, FastAPI's). Load: `{"lora_name", "lora_path", "load_inplace"}`; 200 with
  the text `Success: LoRA adapter 'NAME' added successfully.`; 400 InvalidUserInput when a field is
  empty or the name is taken (unless load_inplace); 404 NotFoundError `Loading lora NAME failed: No
  adapter found for PATH` when the path holds no adapter; 400 BadRequestError when its rank exceeds
  --max-lora-rank. Unload: `{"lora_name"}`; 200 text; 404 NotFoundError when unknown.
* Loading reads the adapter into the instance's adapter cache (evicting the least recently used idle
  one when full) and stalls the engine for the profile's `lora_load_s`, as vLLM's engine core runs
  `add_lora` between steps. A request under a registered adapter that was evicted loads it again.
* Each distinct adapter among a step's sequences adds `lora_per_adapter_step_s` to the step.
* `vllm:lora_requests_info{max_lora, waiting_lora_adapters, running_lora_adapters}` is vLLM's
  prometheus_client gauge, set to the wall-clock time each step for that step's label values
  (comma-joined adapter names, in the order requests hold them); every combination ever set stays
  exported with its last time (readers take the latest).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from adapters.emulator.asgi import Receive, Scope, Send, read_body, respond_with_length
from adapters.emulator.protocol import VALIDATION, ErrorAnswer
from adapters.emulator.settings import RUNTIME_ENV, LoraSettings, runtime_updating_allowed
from core.lora import AdapterSlotsFull, InstanceAdapters

TEXT = [(b"content-type", b"text/plain; charset=utf-8")]
INVALID = "InvalidUserInput"
Handler = Callable[[Scope, Receive, Send], Awaitable[None]]

__all__ = ["RUNTIME_ENV", "EmulatedLora", "LoraSettings", "Registered", "adapter_rank", "runtime_updating_allowed"]


@dataclass(frozen=True, slots=True)
class Registered:
    """An adapter /v1/load_lora_adapter registered (vLLM's LoRARequest)."""

    name: str
    path: str
    int_id: int
    parent: str


def adapter_rank(path: str) -> int | None:
    """The rank in `path`'s PEFT adapter_config.json; None when the path holds no adapter."""
    config = Path(path) / "adapter_config.json"
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    rank = data.get("r") if isinstance(data, dict) else None
    return int(rank) if isinstance(rank, int) else 0


@dataclass
class EmulatedLora:
    """One instance's adapters: what is registered, what is resident, what its steps ran under."""

    settings: LoraSettings
    base_model: str
    load_s: float
    """Seconds one load stalls the engine (the profile's lora_load_s)."""
    per_adapter_step_s: float
    """Seconds each distinct adapter adds to a step (the profile's lora_per_adapter_step_s)."""
    stall: Callable[[float], None] = lambda seconds: None
    """Holds the engine's next step back this many seconds (the app wires it to its engine)."""
    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    registered: dict[str, Registered] = field(default_factory=dict)
    cache: InstanceAdapters = field(init=False)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    """Where `vllm:lora_requests_info` is registered (the app passes its instance's registry)."""
    _ids: Iterator[int] = field(default_factory=lambda: count(1))
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)
    _info: Gauge | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.cache = InstanceAdapters(self.settings.capacity)
        if self.settings.enable_lora:  # vLLM's gauge, label names in its order
            self._info = Gauge(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                registry=self.registry,
            )

    # --- the routes ---------------------------------------------------------------------------
    def routes(self) -> dict[tuple[str, str], Handler]:
        """The load/unload routes, or none unless runtime updating is allowed (vLLM attaches none)."""
        if not (self.settings.enable_lora and self.settings.allow_runtime_updating):
            return {}
        return {("POST", "/v1/load_lora_adapter"): self._load_route, ("POST", "/v1/unload_lora_adapter"): self._unload}

    async def _load_route(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = _body(await read_body(receive), ("lora_name", "lora_path"))
            message = await self.load(str(body["lora_name"]), str(body["lora_path"]), bool(body.get("load_inplace")))
        except ErrorAnswer as e:
            return await respond_with_length(send, e.status, e.body())
        await respond_with_length(send, 200, message.encode(), TEXT)

    async def _unload(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            body = _body(await read_body(receive), ("lora_name",))
            message = self.unload(str(body["lora_name"]))
        except ErrorAnswer as e:
            return await respond_with_length(send, e.status, e.body())
        await respond_with_length(send, 200, message.encode(), TEXT)

    # --- load and unload --------------------------------------------------------------------------
    async def load(self, name: str, path: str, inplace: bool = False) -> str:
        """Register and load an adapter as vLLM does (errors as ErrorAnswer); the success text."""
        lock = self._locks.setdefault(name, asyncio.Lock())
        async with lock:
            if not name or not path:
                raise ErrorAnswer(400, "Both 'lora_name' and 'lora_path' must be provided.", type_=INVALID)
            if not inplace and name in self.registered:
                raise ErrorAnswer(
                    400,
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                    "place, set 'load_inplace' to True.",
                    type_=INVALID,
                )
            rank = adapter_rank(path)
            if rank is None:
                raise ErrorAnswer(404, f"Loading lora {name} failed: No adapter found for {path}")
            if rank > self.settings.max_lora_rank:
                raise ErrorAnswer(400, f"LoRA rank {rank} is greater than max_lora_rank {self.settings.max_lora_rank}.")
            old = self.registered.get(name)
            int_id = old.int_id if old is not None else next(self._ids)
            if inplace:
                self.cache.unload(name)
            await self._make_resident(name)
            self.registered[name] = Registered(name, path, int_id, self.base_model)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> str:
        if not name:
            raise ErrorAnswer(400, "'lora_name' needs to be provided to unload a LoRA adapter.", type_=INVALID)
        if name not in self.registered:
            raise ErrorAnswer(404, f"The lora adapter '{name}' cannot be found.")
        del self.registered[name]
        self.cache.unload(name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    async def _make_resident(self, name: str) -> None:
        """Load into the adapter cache (evicting LRU) and stall the engine for the load; returns when done.
        When every slot holds an adapter a request runs under, it is registered only: the first request
        under it loads it once a slot frees (the engine admits none before)."""
        now = self.clock()
        try:
            placed = self.cache.load(name, now, self.load_s)
        except AdapterSlotsFull:
            return
        if placed.loaded:
            self.stall(self.load_s)
            await asyncio.sleep(max(placed.ready_at - now, 0.0))

    # --- requests under an adapter ---------------------------------------------------------------
    def adapter_of(self, model: str) -> str | None:
        """The adapter a request's `model` names (None: the base model); 404 as vLLM when neither."""
        if model == self.base_model:
            return None
        if model in self.registered:
            return model
        raise ErrorAnswer(404, f"The model `{model}` does not exist.", param="model")

    def acquire(self, adapter: str) -> float:
        """A request under `adapter` is scheduled: seconds until it can run (a load when it was
        evicted, stalling the engine), and the adapter is pinned until `release`."""
        now = self.clock()
        placed = self.cache.acquire(adapter, now, self.load_s)
        if placed.loaded:
            self.stall(self.load_s)
        return max(placed.ready_at - now, 0.0)

    def release(self, adapter: str) -> None:
        self.cache.release(adapter, self.clock())

    def step_cost(self, adapters: Iterable[str | None]) -> float:
        """What the distinct adapters among one step's sequences add to it."""
        distinct = {a for a in adapters if a}
        return self.per_adapter_step_s * len(distinct)

    def observe_step(self, running: Iterable[str | None], waiting: Iterable[str | None]) -> None:
        """One scheduler step's adapters (per sequence, in order): vLLM sets the info gauge's series of
        these label values to the current time (`set_to_current_time`)."""
        if self._info is not None:
            labels = self._info.labels(self.settings.max_loras, _joined(waiting), _joined(running))
            labels.set(self.wall())

    # --- what the instance shows ----------------------------------------------------------------
    def model_cards(self, created: int) -> list[dict[str, Any]]:
        """The /v1/models cards of the registered adapters, shaped as the emulator's base-model card
        (info_api.py); as vLLM's, root is the adapter's path and parent the base model."""
        return [
            {
                "id": r.name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": r.path,
                "parent": r.parent,
                "max_model_len": None,
                "permission": [],
            }
            for r in self.registered.values()
        ]

    def render_metrics(self) -> str:
        """The module's metrics in Prometheus text (its registry: the instance's, when it passed one)."""
        return generate_latest(self.registry).decode() if self.settings.enable_lora else ""


def _body(raw: bytes, required: tuple[str, ...]) -> dict[str, Any]:
    """The JSON body, its required string fields present (else vLLM's 400 validation error)."""
    try:
        body = orjson.loads(raw or b"null")
    except orjson.JSONDecodeError as e:
        raise ErrorAnswer(
            400, f"1 validation error:\n  {{'type': 'json_invalid', 'msg': '{e}'}}", type_=VALIDATION
        ) from e
    if not isinstance(body, dict):
        raise ErrorAnswer(400, "1 validation error:\n  {'type': 'model_attributes_type'}", type_=VALIDATION)
    for name in required:
        if not isinstance(body.get(name), str):
            kind = "missing" if name not in body else "string_type"
            msg = "Field required" if kind == "missing" else "Input should be a valid string"
            err = {"type": kind, "loc": ("body", name), "msg": msg}
            raise ErrorAnswer(400, f"1 validation error:\n  {err}", f"body.{name}", VALIDATION)
    return body


def _joined(adapters: Iterable[str | None]) -> str:
    """Distinct adapter names in first-seen order, comma-joined (vLLM joins its dict's keys)."""
    return ",".join(dict.fromkeys(a for a in adapters if a))
