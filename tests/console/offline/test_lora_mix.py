"""`--lora-adapters N --lora-skew S`: `sim` runs the mix through the simulator's LoRA model, and a replay sends each
request under its adapter as `model`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web
from typer.testing import CliRunner

from console.cli import _register_commands, app
from console.offline.replay import Replayer
from core.traces import Trace

runner = CliRunner()


def test_sim_with_a_lora_mix_reports_adapter_loads_and_affinity_loads_less() -> None:
    args = ["sim", "--workload", "random", "--requests", "300", "--rate", "2", "--cluster", "2P2D"]
    args += ["--profile", "roofline-h100-qwen2.5-7b", "--lora-adapters", "12", "--lora-skew", "1.0", "--max-loras", "2"]
    args += ["--policy", "least_load", "--policy", "lora_affinity", "--no-db", "--json", "--no-shadow"]
    _register_commands(["sim"])
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    rows = {r["policy"]: r for r in json.loads(result.stdout)}
    assert rows["least_load"]["max_loras"] == 2
    assert rows["least_load"]["lora_loads"] > rows["lora_affinity"]["lora_loads"] > 0
    assert rows["least_load"]["lora_loads_per_min"] > 0
    bad = runner.invoke(app, [*args[:9], "--lora-adapters", "0", "--no-db", "--json"])
    assert bad.exit_code != 0


def test_replay_sends_each_lora_request_with_its_adapter_as_model() -> None:
    bodies: list[dict[str, Any]] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n')
        return resp

    async def main() -> None:
        server = web.Application()
        server.router.add_post("/v1/completions", completions)
        runner_ = web.AppRunner(server)
        await runner_.setup()
        site = web.TCPSite(runner_, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            t = Trace("t", [0.0, 0.0, 0.0], [4, 4, 4], [2, 2, 2]).with_lora(["a", None, "b"])
            rep = Replayer.from_trace(t, f"http://127.0.0.1:{port}", model="base", prompt_seed=1)
            await rep.run(drain_timeout_s=5)
        finally:
            await runner_.cleanup()

    asyncio.run(main())
    assert sorted(b["model"] for b in bodies) == ["a", "b", "base"]
