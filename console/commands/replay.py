"""`sibyl-console replay`: replay a trace against a console's gateway (or any OpenAI endpoint)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import signal
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from console.commands.options import DbOpt
from console.commands.sim import LoraAdaptersOpt, LoraSkewOpt, with_lora_mix
from core.errors import ConfigError

# httpx, rich, the trace readers, the replayer and the run store load inside the command.


def load_window(
    trace: Path,
    fmt: str,
    seed: int,
    start: float,
    duration: float | None,
    limit: int | None,
    session_min_blocks: int | None = None,
) -> Any:
    """The rows to replay; with `session_min_blocks`, sessions are derived from the hash ids of the
    whole trace first, so a row whose earlier turns fall before the window keeps their session."""
    from core.traces import read_trace

    t = read_trace(trace, fmt, seed=seed)
    if session_min_blocks is not None:
        t = t.with_sessions(session_min_blocks)
    t = t.window(start=start, duration=duration, limit=limit)
    if len(t) == 0:
        raise ConfigError(f"{trace}: no requests in the window start={start}s duration={duration} limit={limit}")
    return t


def max_model_len(url: str, model: str | None) -> int | None:
    """The served model's context length from /v1/models, when the server says it."""
    import httpx

    try:
        data = httpx.get(url.rstrip("/") + "/v1/models", timeout=5).json().get("data", [])
    except (httpx.HTTPError, ValueError):
        return None
    lens = [
        m.get("max_model_len")
        for m in data
        if (model is None or m.get("id") == model) and isinstance(m.get("max_model_len"), int)
    ]
    return min(lens) if lens else None


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def replay(
    trace: Annotated[Path, typer.Argument(help="trace file or ServeGen folder")],
    format: Annotated[str, typer.Option("--format", help="auto|mooncake|azure|burstgpt|servegen")] = "auto",
    url: Annotated[
        str | None, typer.Option(help="OpenAI-compatible base URL (default: the local console's gateway)")
    ] = None,
    model: Annotated[str | None, typer.Option(help="model name to send (default: the server's)")] = None,
    speed: Annotated[float, typer.Option(help="time compression: 2 sends twice as fast as the trace")] = 1.0,
    start: Annotated[float, typer.Option(help="skip the trace's first S seconds")] = 0.0,
    duration: Annotated[float | None, typer.Option(help="replay D seconds of the trace")] = None,
    limit: Annotated[int | None, typer.Option(min=1, help="at most N requests")] = None,
    max_concurrency: Annotated[int | None, typer.Option(min=1, help="cap on requests in flight")] = None,
    max_context: Annotated[
        int | None, typer.Option(help="clip prompt + output to N tokens (default: the model's max_model_len)")
    ] = None,
    seed: Annotated[int, typer.Option(help="seed for ServeGen sampling")] = 0,
    prompt_seed: Annotated[
        int | None,
        typer.Option(
            help="seed of the prompts' token ids (default: fresh each replay, "
            "so no server's prefix cache serves a repeat)"
        ),
    ] = None,
    prefixes: Annotated[
        bool,
        typer.Option(
            "--prefixes/--no-prefixes",
            help="keep the trace's prefix structure (Mooncake hash_ids: rows sharing leading hash ids share "
            "that prompt prefix; sessions sent as X-Session-ID); --no-prefixes sends every row fresh ids",
        ),
    ] = True,
    hash_block_tokens: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="tokens per hash block (default: the trace's native 512); smaller scales prompts down, e.g. 16 for a "
            "tiny model: each 512-token block becomes 16 tokens and every prompt length is scaled by 16/512",
        ),
    ] = None,
    session_min_blocks: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="a row continues the session of the latest earlier row sharing its "
            "longest hash-id prefix when that prefix has at least N blocks (default 2, which skips "
            "the system-prompt block every Mooncake conversation row starts with)",
        ),
    ] = None,
    lora_adapters: LoraAdaptersOpt = None,
    lora_skew: LoraSkewOpt = 1.0,
    db: DbOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print a JSON summary at the end")] = False,
) -> None:
    """Open-loop replay of a trace: token-id prompts of each row's length, outputs forced with
    max_tokens + ignore_eos, arrivals honoured (÷ --speed). Client-side TTFT/TPOT/E2E of every
    request go to the run store, linked to the local console's run. Ctrl-C stops sending, waits
    for in-flight requests (bounded) and keeps everything recorded.

    A Mooncake trace keeps its prefix structure: each hash id is a fixed block of token ids
    (seeded by --prompt-seed), so requests sharing leading hash ids share a real prefix a
    server's prefix cache can reuse, and a session derived from the hash ids goes out as the
    X-Session-ID header. A new --prompt-seed shares nothing with an earlier replay.

    A request under a LoRA adapter (the trace's `lora` column, or --lora-adapters N --lora-skew S)
    is sent with `model` = the adapter's name.

    Examples:
      sibyl-console replay ../shared/traces/azure_llm_2023/AzureLLMInferenceTrace_conv.csv --limit 500 --speed 4
      sibyl-console replay ../shared/traces/mooncake_fast25/conversation_trace.jsonl --duration 60 --url http://10.0.0.9:8000
      sibyl-console replay ../shared/traces/mooncake_fast25/conversation_trace.jsonl --limit 200 --hash-block-tokens 16
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from adapters.store import RunRecorder, RunStore
    from console.live.discovery import ConsoleNotFound, locate
    from console.offline.replay import Replayer
    from core.traces.prompts import NATIVE_BLOCK_TOKENS
    from core.traces.sessions import DEFAULT_MIN_SHARED_BLOCKS

    hash_block_tokens = NATIVE_BLOCK_TOKENS if hash_block_tokens is None else hash_block_tokens
    session_min_blocks = DEFAULT_MIN_SHARED_BLOCKS if session_min_blocks is None else session_min_blocks
    if speed <= 0:
        raise ConfigError("--speed must be > 0")
    t = load_window(trace, format, seed, start, duration, limit, session_min_blocks if prefixes else None)
    t = with_lora_mix(t, lora_adapters, lora_skew, seed)
    hashed = prefixes and t.hash_ids is not None
    if hash_block_tokens != NATIVE_BLOCK_TOKENS and not hashed:
        why = "--no-prefixes" if not prefixes else f"{trace.name} has no hash_ids (only Mooncake traces do)"
        raise ConfigError(f"--hash-block-tokens {hash_block_tokens} scales hash blocks, but {why}")
    parent = None
    try:
        local = locate()
    except ConsoleNotFound as e:
        if url is None:
            raise ConfigError(f"{e} (replay needs a target: start `sibyl-console up` or pass --url)") from None
    else:
        if url is None or url.rstrip("/") == local.url.rstrip("/"):  # the local console's run serves this replay
            url, parent = local.url, local.run_id
    assert url is not None
    context = max_context or max_model_len(url, model)
    prompt_seed = secrets.randbits(32) if prompt_seed is None else prompt_seed
    store = RunStore(db)
    store.mark_interrupted_runs()
    run_id = store.create_run(
        kind="replay",
        backend="client",
        workload=t.source or t.name,
        seed=seed,
        parent_run_id=parent,
        config={
            "trace": str(trace),
            "url": url,
            "speed": speed,
            "start": start,
            "duration": duration,
            "limit": limit,
            "max_concurrency": max_concurrency,
            "max_context": context,
            "prompt_seed": prompt_seed,
            "prefixes": hashed,
            "hash_block_tokens": hash_block_tokens if hashed else None,
            "session_min_blocks": session_min_blocks if hashed else None,
            "sessions": len(set(t.session.tolist())) if hashed and t.session is not None else None,
            "lora_adapters": None if t.lora is None else len({a for a in t.lora if a}),
        },
    )
    recorder = RunRecorder(store, run_id)
    rep = Replayer.from_trace(
        t,
        url,
        prefix=prefixes,
        hash_block_tokens=hash_block_tokens,
        model=model,
        speed=speed,
        max_concurrency=max_concurrency,
        max_context=context,
        on_result=recorder.request,
        prompt_seed=prompt_seed,
        id_prefix=run_id,
    )
    err = Console(stderr=True)
    started = time.monotonic()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, rep.stop)
        runner = asyncio.create_task(rep.run())
        cols = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[line]}"),
        )
        with Progress(*cols, console=err, transient=as_json) as progress:
            task = progress.add_task("replay", total=len(t), line="")
            while not runner.done():
                s = rep.stats.snapshot()
                line = (
                    f"sent {s['sent']} done {s['done']} failed {s['failed']}  TTFT p50/p99 "
                    f"{_fmt(s['ttft_p50'])}/{_fmt(s['ttft_p99'])} ms  TPOT p50/p99 "
                    f"{_fmt(s['tpot_p50'])}/{_fmt(s['tpot_p99'])} ms"
                )
                progress.update(task, completed=s["done"] + s["failed"], line=line)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(runner), 0.5)
            progress.update(task, completed=rep.stats.done + rep.stats.failed)
        await runner

    status = "completed"
    try:
        asyncio.run(main())
        if rep.status == "stopped":
            status = "interrupted"
    finally:
        s = rep.stats.snapshot()
        recorder.close(status=status, summary={**s, "wall_s": time.monotonic() - started})
    summary = {
        "run_id": run_id,
        "parent_run_id": parent,
        "requests": len(t),
        **s,
        "wall_s": time.monotonic() - started,
        "status": status,
    }
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
    else:
        err.print(f"replay run {run_id}: {s['done']} done, {s['failed']} failed of {len(t)} ({status})")


def register(app: typer.Typer) -> None:
    app.command("replay")(replay)
