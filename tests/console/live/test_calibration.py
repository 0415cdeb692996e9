"""The calibration feed on a real emulated instance: a prior 10× too slow converges from its scrapes."""

from __future__ import annotations

import random
import threading
from pathlib import Path

import httpx
import pytest

from adapters.emulator.process import running
from adapters.vllm.scrape import histogram_delta, read_histograms
from console.live.calibration import HISTOGRAMS, CalibrationFeed
from core.perf import PerfProfile
from tests.emulator_fixtures import profile_file

EMULATED = PerfProfile(
    name="emulated",
    description="the engine the emulator runs: ~3 ms steps, 20 µs per prompt token",
    prefill_base_s=0.002,
    prefill_per_token_s=2e-5,
    decode_step_base_s=0.003,
    decode_step_per_seq_s=2e-4,
    kv_capacity_tokens=65536,
    block_size=16,
    max_num_seqs=64,
    max_model_len=2048,
)
PRIOR = EMULATED.model_copy(
    update={
        "name": "prior",
        **{k: 10 * getattr(EMULATED, k) for k in ("prefill_base_s", "prefill_per_token_s")},
        **{k: 10 * getattr(EMULATED, k) for k in ("decode_step_base_s", "decode_step_per_seq_s")},
    }
)
ROUNDS = [(1, 32), (4, 400), (8, 100), (2, 800), (16, 200), (1, 1200), (6, 50), (12, 600), (20, 64), (3, 300)]
"""(concurrent clients, prompt tokens) of each round; a scrape after each. The test plays them three
times: a contended round's rows err by how its prompts happened to share steps, and more of them
average that (played twice, one small round's row off by 3x moved the fit at 32 tokens by +53%; played
three times, by +5%)."""
PLAYS = 3


def test_the_feed_fits_an_emulated_engine_ten_times_faster_than_its_prior(tmp_path: Path) -> None:
    args = ["--profile", profile_file(tmp_path, EMULATED), "--no-enable-prefix-caching"]
    with running(("both", args), log_dir=tmp_path) as (emu,), httpx.Client(timeout=30) as http:
        feed = CalibrationFeed(PRIOR, refit_every_s=0)
        assert feed.profile_for("p0") == PRIOR.model_copy(update={"fit": feed.profile_for("p0").fit})
        feed.observe_scrape("p0", http.get(emu.url + "/metrics").text)
        rng = random.Random(7)

        def client(prompt_tokens: int) -> None:
            with httpx.Client(timeout=30) as c:
                for _ in range(2):
                    body = {"prompt": [rng.randrange(10, 1000) for _ in range(prompt_tokens)], "max_tokens": 16}
                    r = c.post(emu.url + "/v1/completions", json={**body, "ignore_eos": True})
                    assert r.status_code == 200

        measured: dict[int, float] = {}  # an uncontended round's mean prefill time, as the emulator timed it
        before = http.get(emu.url + "/metrics").text
        for clients, prompt_tokens in ROUNDS * PLAYS:
            threads = [threading.Thread(target=client, args=(prompt_tokens,)) for _ in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            after = http.get(emu.url + "/metrics").text
            feed.observe_scrape("p0", after)
            if clients == 1:
                name = HISTOGRAMS["prefill_time"]
                h = histogram_delta(read_histograms(before, [name])[name], read_histograms(after, [name])[name])
                assert h.count == 2 and h.mean is not None
                measured[prompt_tokens] = h.mean
            before = after

    terms = feed.snapshot()["p0"]
    fitted = feed.profile_for("p0")
    for name in ("decode_step_base_s", "prefill_per_token_s", "decode_step_per_seq_s"):
        assert terms[name]["source"].startswith("fit"), (name, terms[name])
        assert terms[name]["prior"] == getattr(PRIOR, name)
        assert terms[name]["samples"] > 0 and terms[name]["age_s"] is not None and terms[name]["residual"] < 0.3

    # what the projection uses: an uncontended prefill (its step included) and decode steps. The
    # uncontended rounds' rows are exact; a contended round's step size is inferred from
    # iteration_tokens' doubling buckets, and how its prompts happened to share steps differs from
    # run to run. Over 15 runs of the rounds played once, the fit at 1,200 tokens was off by 14% on
    # average and 30% at most, its residual up to 0.24 (one CI run failed a 20% gate at +21.5%);
    # played twice, 12% and 20% at most (10 runs), residual up to 0.19, but one CI run in ~40 put the
    # fit at 32 tokens at +78%; played three times (9 runs), 32 tokens -1% to +12%, 1,200 tokens -18%
    # to +10%. So: within 30% of the uncontended prefills the emulator timed (on its engine clock), of
    # its profile, and far from the prior (10x) at every size
    def uncontended(profile: PerfProfile, tokens: int) -> float:
        return float(profile.prefill_time(tokens)) + profile.step_time(1, tokens)

    assert set(measured) == {32, 1200}
    fit = {k: v["value"] for k, v in terms.items()}
    for tokens, seconds in measured.items():
        assert uncontended(fitted, tokens) == pytest.approx(seconds, rel=0.3), (tokens, measured, fit)
    for tokens in (100, 500, 1000):
        assert uncontended(fitted, tokens) == pytest.approx(uncontended(EMULATED, tokens), rel=0.3)
        assert uncontended(fitted, tokens) < uncontended(PRIOR, tokens) / 4
    # decode steps: within 30% of the profile at small batches
    for batch in (1, 4):
        assert fitted.step_time(batch, batch * 300) == pytest.approx(EMULATED.step_time(batch, batch * 300), rel=0.3)
    assert terms["kv_transfer_base_s"]["source"].startswith("prior: no samples")  # no P/D hand-off was timed
    assert feed.queue_time_s("p0") is not None
    feed.forget("p0")
    assert feed.snapshot() == {}
