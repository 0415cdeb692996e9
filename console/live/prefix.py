"""The live console's view of the instances' KV caches: each request's prefix keys and the index's source.

A request's prefix keys are our own hash chain (core.cache.keys) over the token ids the engine will
see, in the engine's block size. Token-id prompts (what `replay` sends) are hashed as they are; text
and chat prompts are tokenized in the gateway with the model's tokenizer and chat template
(adapters/tokenizer.py) when `[prefix] tokenizer` names them or `--backend vllm` launches a local
model directory, else (and for what the local path declines) by a prefill instance's `POST
/tokenize`, which applies the chat template exactly as the engine will; `[prefix] tokenize` picks
(auto, local, instance, off). The index behind routing is
*approximate* (what the router sent where, for a TTL, bounded by each instance's KV capacity) or
*precise* (each instance's own KV events, read by one subscriber per instance: adapters/vllm/kv_events).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from adapters.tokenizer import LocalTokenizer
from adapters.vllm.instances import Instance
from adapters.vllm.kv_events import KVEventSubscriber
from console.live.config import PrefixSettings
from core.cache.keys import prompt_keys
from core.dispatch import Dispatcher
from core.types import Role

log = logging.getLogger(__name__)

TOKENIZE_TIMEOUT_S = 2.0
"""A /tokenize call that takes longer leaves the request without prefix keys (it is routed by load)."""


def token_ids(body: dict[str, Any]) -> list[int] | None:
    """The prompt's token ids when the client sent ids (a list of ints, or one such list in a list)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return prompt
    return None


NO_TOKENIZE_STATUSES = frozenset({404, 405, 501})
"""Answers that say an instance has no /tokenize at all (an OpenAI server that is not vLLM): it is not asked again."""


async def engine_token_ids(
    body: dict[str, Any], instances: Sequence[Instance], without: set[str] | None = None
) -> list[int] | None:
    """Tokenize a text or chat prompt on the first healthy instance, as the engine will; an instance
    that answers it has no /tokenize is added to `without` and skipped from then on."""
    if "messages" in body:
        payload: dict[str, Any] = {"messages": body["messages"]}
    elif isinstance(body.get("prompt"), str):
        payload = {"prompt": body["prompt"]}
    else:
        return None
    for inst in instances:
        if not inst.healthy or inst.session is None or (without is not None and inst.id in without):
            continue
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with inst.session.post(
                "/tokenize", json=payload, timeout=aiohttp.ClientTimeout(total=TOKENIZE_TIMEOUT_S)
            ) as r:
                if r.status == 200:
                    tokens = (await r.json()).get("tokens")
                    if isinstance(tokens, list):
                        return [int(t) for t in tokens]
                elif r.status in NO_TOKENIZE_STATUSES and without is not None:
                    log.warning(
                        "%s has no /tokenize (HTTP %d): text and chat prompts are routed without prefix keys "
                        "unless another prefill instance or a local tokenizer ([prefix] tokenizer) keys them",
                        inst.id,
                        r.status,
                    )
                    without.add(inst.id)
                    continue
        return None
    return None


def default_tokenizer(backend: str, model: str | None, vllm_args: Sequence[str]) -> str | None:
    """The tokenizer `--backend vllm` loads from a local model directory, unless its arguments give
    vLLM another tokenizer or chat template (then only an instance's /tokenize is exact)."""
    if backend != "vllm" or not model or any(a.split("=")[0] in ("--tokenizer", "--chat-template") for a in vllm_args):
        return None
    folder = Path(model).expanduser()
    return str(folder) if (folder / "tokenizer.json").is_file() else None


def load_tokenizer(settings: PrefixSettings, default: str | None) -> LocalTokenizer | None:
    """The local tokenizer `[prefix]` asks for: `tokenizer` (an error if it does not load), else the
    default (a warning if it does not load: /tokenize still works)."""
    if settings.tokenize not in ("auto", "local") or settings.source == "off":
        return None
    if settings.tokenizer:
        try:
            return LocalTokenizer.load(settings.tokenizer)
        except (OSError, ValueError) as e:
            raise ValueError(f"[prefix] tokenizer {settings.tokenizer!r} does not load: {e}") from e
    if default:
        try:
            return LocalTokenizer.load(default)
        except (OSError, ValueError) as e:
            log.warning("the model's tokenizer at %s does not load (%s): text prompts go to /tokenize", default, e)
    return None


class PrefixIndex:
    """Sets the dispatcher's cache source, computes request keys, and runs the KV-event subscribers."""

    def __init__(
        self, settings: PrefixSettings, dispatcher: Dispatcher, block_size: int, tokenizer: str | None = None
    ) -> None:
        self.settings = settings
        self.dispatcher = dispatcher
        self.block_size = settings.block_size or block_size
        """The block size keys are computed in (the engines' own)."""
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self._forgetting: set[asyncio.Task[None]] = set()
        self.keyed = self.unkeyed = 0
        """Requests that got prefix keys / did not (no ids and no tokenizer)."""
        self.tokenize_s = 0.0
        """Time spent in /tokenize calls (the gateway's added latency for text and chat prompts)."""
        self.local = load_tokenizer(settings, tokenizer)
        """The model's tokenizer in the gateway (None: text and chat prompts go to /tokenize, or nowhere)."""
        self.no_tokenize: set[str] = set()
        """Instances that answered they have no /tokenize (never asked again)."""
        self.local_s = 0.0
        self.local_n = 0
        """Time spent tokenizing locally, and how many prompts were."""
        s = settings
        if s.source == "approximate":
            dispatcher.use_prefix_routes(self.block_size, ttl_s=s.ttl_s, decode_only=s.decode_only)
        elif s.source == "precise":
            dispatcher.use_prefix_events(self.block_size, decode_only=s.decode_only)

    def known_keys(
        self, body: dict[str, Any], tokenize: bool = True, lora: str | None = None
    ) -> tuple[int, ...] | None:
        """The prefix keys of a request body without any I/O: empty when the cache is off or the
        prompt has no ids; None when a text or chat prompt must go through `tokenized_keys` (only
        when `tokenize`: the active routing policy reads the cache). Token-id prompts are hashed
        here (microseconds), and text and chat prompts the local tokenizer takes are tokenized here
        too, so the hot path awaits nothing for them. Under LoRA adapter `lora` the keys carry it (as
        vLLM's do): a prefix cached under one adapter never matches another's nor the base model's."""
        if self.settings.source == "off":
            return ()
        ids = token_ids(body)
        if ids is None:
            mode = self.settings.tokenize
            if not tokenize or mode == "off" or not ("messages" in body or isinstance(body.get("prompt"), (str, list))):
                self.unkeyed += 1
                return ()
            if self.local is not None:
                t = time.perf_counter()
                ids = self.local.token_ids(body)
                self.local_s += time.perf_counter() - t
                self.local_n += 1
            if ids is None:
                if mode in ("auto", "instance") and ("messages" in body or isinstance(body.get("prompt"), str)):
                    return None
                self.unkeyed += 1
                return ()
        self.keyed += 1
        return tuple(prompt_keys(ids, self.block_size, lora))

    async def tokenized_keys(
        self, body: dict[str, Any], instances: Iterable[Instance], lora: str | None = None
    ) -> tuple[int, ...]:
        """The prefix keys of a text or chat prompt, tokenized by a prefill instance's /tokenize."""
        t = time.perf_counter()
        ids = await engine_token_ids(body, [i for i in instances if i.role != Role.DECODE], self.no_tokenize)
        self.tokenize_s += time.perf_counter() - t
        if not ids:
            self.unkeyed += 1
            return ()
        self.keyed += 1
        return tuple(prompt_keys(ids, self.block_size, lora))

    async def lookup(self, body: dict[str, Any], instances: Iterable[Instance]) -> dict[str, Any]:
        """Where a request body's blocks are cached as routing sees it (POST /control/prefix/match):
        its keys as the gateway computes them (not counted in the keyed share) and, per instance
        holding its first block, how many leading blocks it holds."""
        counters = (self.keyed, self.unkeyed, self.tokenize_s, self.local_s, self.local_n)
        try:
            keys = self.known_keys(body)
            if keys is None:
                keys = await self.tokenized_keys(body, instances)
        finally:
            self.keyed, self.unkeyed, self.tokenize_s, self.local_s, self.local_n = counters
        index = self.dispatcher.prefix.index
        held = index.match(keys, time.monotonic()) if index is not None and keys else {}
        return {
            "source": self.settings.source,
            "block_size": self.block_size,
            "blocks": len(keys),
            "match": {str(i): n for i, n in held.items()},
            "indexed_blocks": {str(i): index.num_blocks(i) for i in index.instances} if index is not None else {},
        }

    # --- precise: KV events -------------------------------------------------------------------
    def follow(self, inst: Instance) -> None:
        """Subscribe to an instance's KV events (precise source; instances that publish them)."""
        if self.settings.source != "precise" or inst.kv_events_endpoint is None or inst.id in self.subscribers:
            return
        sub = KVEventSubscriber(
            inst.id, inst.kv_events_endpoint, self.dispatcher.apply_kv_events, replay_endpoint=inst.kv_events_replay
        )
        sub.start()
        self.subscribers[inst.id] = sub

    def lost(self, instance_id: str) -> None:
        """An instance went down: what it cached can no longer be trusted."""
        sub = self.subscribers.get(instance_id)
        if sub is not None:
            sub.mark_down()
        elif self.settings.source != "off":
            self.dispatcher.clear_prefix_cache(instance_id)

    def removed(self, instance_id: str) -> None:
        """An instance left the cluster: its subscriber is stopped and its blocks forgotten (in a task)."""
        task = asyncio.create_task(self.forget(instance_id), name=f"prefix-forget-{instance_id}")
        self._forgetting.add(task)
        task.add_done_callback(self._forgetting.discard)

    async def forget(self, instance_id: str) -> None:
        """An instance left the cluster."""
        sub = self.subscribers.pop(instance_id, None)
        if sub is not None:
            await sub.stop()
        if self.settings.source != "off":
            self.dispatcher.clear_prefix_cache(instance_id)

    async def close(self) -> None:
        """Cancel the forgetting under way, stop every subscriber."""
        for task in list(self._forgetting):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for iid in list(self.subscribers):
            sub = self.subscribers.pop(iid)
            await sub.stop()

    def snapshot(self) -> dict[str, Any]:
        """For `status` and the state: the source, block size, keyed share, per-instance event lag."""
        lags = {}
        for iid, sub in self.subscribers.items():
            lag = sub.lag()
            lags[iid] = {
                "endpoint": sub.endpoint,
                "connected": lag.connected,
                "last_seq": lag.last_seq,
                "events_per_s": lag.events_per_s,
                "since_last_event_s": lag.since_last_event_s,
                "gaps_filled": lag.gaps_filled,
                "gaps_unfilled": lag.gaps_unfilled,
                "restarts": lag.restarts,
                "unresolved": lag.unresolved,
                "bad_messages": lag.bad_messages,
                "events": lag.events,
            }
        total = self.keyed + self.unkeyed
        return {
            "source": self.settings.source,
            "block_size": self.block_size,
            "keyed_share": self.keyed / total if total else None,
            "tokenize_ms_mean": 1e3 * self.tokenize_s / total if total else None,
            "tokenizer": self.local.source if self.local is not None else None,
            "local_tokenize_ms_mean": 1e3 * self.local_s / self.local_n if self.local_n else None,
            "events": lags,
        }
