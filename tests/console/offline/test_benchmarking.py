"""`bench decision`: the dispatcher states it loads and times, for policy settings and oracles, and with
`--prefix-tokens` the prefix scorer's state (each prefill instance at its own depth)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from console.cli import _register_commands, app
from console.offline.benchmarking import add_prefix_caches, loaded_dispatcher
from core.perf import get_profile
from core.types import Request
from tests.helpers import toy_profile

_register_commands()


def test_each_prefill_instance_holds_the_prompts_to_its_own_depth() -> None:
    d = loaded_dispatcher(
        get_profile("h20-qwen3-32b"),
        "prefix_aware",
        {},
        prefill_instances=6,
        decode_instances=2,
        running_per_instance=2,
        pending_per_instance=1,
    )
    prompts = add_prefix_caches(d, prompt_tokens=4096, blocks_per_instance=2000, probes=3)
    assert [len(p) for p in prompts] == [256] * 3
    index = d.prefix.index
    assert index is not None and all(index.num_blocks(f"p{i}") == 2000 for i in range(6))
    for keys in prompts:
        depths = index.match(keys)
        assert set(depths) == {f"p{i}" for i in range(6)} and all(1 <= n <= 256 for n in depths.values())
        assert depths == index.match(keys, exact=True)
        cached = d.view.cached_tokens(Request("r", 0.0, 4096, 10, prefix_keys=keys))
        assert np.count_nonzero(cached) == 6  # the prefix scorer reads them (decode instances hold none)
        d.view.forget_cached()


def test_bench_decision_with_the_prefix_scorer() -> None:
    result = CliRunner().invoke(
        app,
        [
            "bench",
            "decision",
            "--policy",
            "prefix_aware",
            "--prefill-instances",
            "8",
            "--decode-instances",
            "4",
            "--running-per-instance",
            "4",
            "--prefix-tokens",
            "2048",
            "--prefix-blocks",
            "1000",
            "--iterations",
            "30",
            "--json",
        ],
    )
    assert result.exit_code == 0, result.stdout
    data = json.loads(result.stdout)
    assert data["prefix_tokens"] == 2048 and data["prefill_instances"] == 8
    assert 0 < data["p50_us"] <= data["p99_us"]


def test_bench_decision_times_policy_settings_and_oracles() -> None:
    from console.offline.benchmarking import decision_latency, loaded_dispatcher
    from core.errors import PolicyError
    from core.policies import parse_policy_spec

    assert parse_policy_spec("sibyl") == ("sibyl", {})
    assert parse_policy_spec("sibyl:horizon=lifetime,unit=requests") == (
        "sibyl",
        {"horizon": "lifetime", "unit": "requests"},
    )
    assert parse_policy_spec("least_load(by=tokens, bind=arrival)") == (
        "least_load",
        {"by": "tokens", "bind": "arrival"},
    )
    for bad in ("sibyl:horizon", "(by=tokens)", "x(=1)"):
        with pytest.raises(PolicyError, match="key=value|no name"):
            parse_policy_spec(bad)
    for name, params in (("sibyl", {"horizon": "lifetime"}), ("clairvoyant", {})):
        d = loaded_dispatcher(
            toy_profile(),
            name,
            params,
            prefill_instances=1,
            decode_instances=4,
            running_per_instance=4,
            pending_per_instance=1,
        )
        row = decision_latency(d, iterations=20, warmup=2)
        assert row["tracked_requests"] == 20 and row["p99_us"] > 0
