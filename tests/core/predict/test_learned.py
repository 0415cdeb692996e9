"""The learned remaining-length predictor (needs torch): training, accuracy, model files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.torch

torch = pytest.importorskip("torch")

from core.predict import SurvivalPredictor, residual_samples  # noqa: E402
from core.predict.learned import LearnedPredictor, load, split_requests, train  # noqa: E402


def _workload(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Output length depends on the prompt (two populations) plus noise."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(10, 2000, n)
    long = prompt > 1000
    base = np.where(long, 3000.0, 300.0)
    out = np.clip((base * rng.lognormal(0.0, 0.25, n)).astype(np.int64), 1, 8000)
    return prompt, out


@pytest.fixture(scope="module")
def trained() -> tuple[LearnedPredictor, object]:
    prompt, out = _workload(1500, seed=1)
    return train(
        prompt,
        out,
        max_len=8000,
        hidden=(32, 32),
        epochs=12,
        max_samples=12_000,
        seed=0,
        patience=4,
    )


def test_learned_beats_a_constant_and_the_survival_predictor(trained: tuple) -> None:
    model, report = trained
    prompt, out = _workload(800, seed=2)  # held-out requests
    rng = np.random.default_rng(5)
    req, age, rem = residual_samples(out, max_samples=20_000, rng=rng)
    mae_learned = float(np.mean(np.abs(model.predict(prompt[req], age) - rem)))
    constant = float(np.median(rem))
    mae_const = float(np.mean(np.abs(constant - rem)))
    survival = SurvivalPredictor.from_lengths(_workload(1500, seed=1)[1], max_len=8000)
    mae_surv = float(np.mean(np.abs(survival.median_remaining(age) - rem)))
    assert mae_learned < 0.8 * mae_const
    assert mae_learned < mae_surv  # the prompt length carries information Ŝ cannot see
    assert report.best_epoch >= 1 and report.val_mae < mae_const  # type: ignore[attr-defined]


def test_predictions_are_clamped_to_the_output_cap(trained: tuple) -> None:
    model, _ = trained
    gen = np.array([0.0, 7990.0, 7999.0])
    pred = model.predict(np.array([1500, 1500, 1500]), gen)
    assert np.all(pred >= 1.0) and np.all(pred <= np.maximum(8000 - gen, 1.0))


def test_save_and_load_round_trip(trained: tuple, tmp_path: Path) -> None:
    model, _ = trained
    path = tmp_path / "model.pt"
    model.save(path)
    again = load(path)
    prompt, out = _workload(50, seed=3)
    age = np.minimum(out - 1, 100)
    assert np.allclose(again.predict(prompt, age), model.predict(prompt, age))
    assert again.n_params == model.n_params == 8 * 32 + 32 + 32 * 32 + 32 + 32 + 1
    bad = tmp_path / "bad.pt"
    torch.save({"format": "something else"}, str(bad))
    with pytest.raises(ValueError, match="not a"):
        load(bad)


def test_training_is_seeded_and_the_split_is_by_request() -> None:
    kept, held = split_requests(100, 0.2, np.random.default_rng(0))
    assert len(held) == 20 and len(kept) == 80 and not set(kept) & set(held)
    prompt, out = _workload(200, seed=4)
    a, _ = train(prompt, out, hidden=(8,), epochs=2, max_samples=2000, seed=7)
    b, _ = train(prompt, out, hidden=(8,), epochs=2, max_samples=2000, seed=7)
    x = np.array([100, 1500])
    assert np.array_equal(a.predict(x, np.array([0.0, 0.0])), b.predict(x, np.array([0.0, 0.0])))


def test_ares_runs_with_a_learned_model(trained: tuple, tmp_path: Path) -> None:
    import core.policies.ares  # noqa: F401
    from core.policies import registry
    from core.types import PolicyKind

    model, _ = trained
    path = tmp_path / "m.pt"
    model.save(path)
    policy = registry.build(PolicyKind.RESCHEDULE, "ares", {"predictor": "learned", "model_path": str(path)})
    from tests.core.policies.states import decode_cluster, run_observed

    d = decode_cluster(2, max_model_len=8000)
    for k in range(4):
        run_observed(d, f"a{k}", "d0", prompt=1500, generated=10, out=8000)
    run_observed(d, "b", "d1", prompt=100, generated=10, out=8000)
    moves = policy.propose(d.view, 0.0)
    assert [(m.source, m.target) for m in moves] == [("d0", "d1")]
