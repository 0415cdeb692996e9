"""A small learned remaining-length predictor: an MLP over the features the console sees.

ARES (spec §2.6) regresses the remaining length from the target LLM's last-layer hidden state
with an L1 loss. The console has no hidden states (stock vLLM does not expose them), so this
model regresses on `core.predict.features` instead (prompt length, tokens generated, survival
statistics of the workload at the request's age), with the paper's recipe: L1 loss, AdamW,
early stopping on validation MAE, samples every 20 generated tokens split by request.

torch is an optional extra: it is imported only inside `train`, `save` and `load`. Inference
runs on NumPy copies of the weights, so a loaded model predicts without torch's per-call cost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.predict.features import FEATURE_NAMES, features, residual_samples
from core.predict.survival import SurvivalPredictor

FORMAT = "sibyl-remaining-mlp/1"
"""Tag stored in every model file."""

EpochCallback = Callable[[int, float, float], None]
"""on_epoch(epoch, train L1 loss in tokens, validation MAE in tokens)."""


@dataclass(frozen=True)
class TrainReport:
    """How a training run went."""

    epochs: int
    best_epoch: int
    train_mae: float
    """MAE (tokens) on the training samples at the best epoch."""
    val_mae: float
    """MAE (tokens) on the validation samples at the best epoch."""
    train_samples: int
    val_samples: int
    train_requests: int
    val_requests: int
    seconds: float


def _require_torch() -> Any:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - depends on the installation
        raise ImportError("the learned predictor needs torch: pip install -e '.[predict]'") from exc
    return torch


class LearnedPredictor:
    """Remaining output tokens = clamp(MLP(standardised features) · scale, 1, max_len − generated)."""

    def __init__(
        self,
        layers: Sequence[tuple[np.ndarray, np.ndarray]],
        *,
        mean: np.ndarray,
        std: np.ndarray,
        scale: float,
        survival: SurvivalPredictor,
        max_len: int,
        meta: dict[str, Any] | None = None,
    ) -> None:
        if not layers:
            raise ValueError("an MLP needs at least one layer")
        if layers[0][0].shape[1] != len(FEATURE_NAMES):
            raise ValueError(f"first layer takes {layers[0][0].shape[1]} inputs, features are {len(FEATURE_NAMES)}")
        self.layers = [(np.asarray(w, dtype=float), np.asarray(b, dtype=float)) for w, b in layers]
        self.mean = np.asarray(mean, dtype=float)
        self.std = np.asarray(std, dtype=float)
        self.scale = float(scale)
        self.survival = survival
        """Ŝ of the training requests: the per-workload statistics the features are taken from."""
        self.max_len = int(max_len)
        self.meta: dict[str, Any] = dict(meta or {})

    @property
    def n_params(self) -> int:
        return sum(w.size + b.size for w, b in self.layers)

    def predict(self, prompt: np.ndarray, generated: np.ndarray) -> np.ndarray:
        """Predicted remaining output tokens per request (float, ≥ 1)."""
        g = np.asarray(generated, dtype=float)
        x = (features(prompt, g, self.survival) - self.mean) / self.std
        last = len(self.layers) - 1
        for k, (w, b) in enumerate(self.layers):
            x = x @ w.T + b
            if k < last:
                x = np.maximum(x, 0.0)
        y = x[:, 0] * self.scale
        out: np.ndarray = np.clip(y, 1.0, np.maximum(self.max_len - g, 1.0))
        return out

    # --- persistence ----------------------------------------------------------------------------
    def save(self, path: str | Path) -> None:
        """Write the model (weights, normalisation, survival table, metadata) with torch.save."""
        torch = _require_torch()
        delta, values = self.survival.table()
        blob: dict[str, Any] = {
            "format": FORMAT,
            "features": list(FEATURE_NAMES),
            "weights": [torch.tensor(w) for w, _ in self.layers],
            "biases": [torch.tensor(b) for _, b in self.layers],
            "mean": torch.tensor(self.mean),
            "std": torch.tensor(self.std),
            "scale": self.scale,
            "max_len": self.max_len,
            "survival_delta": int(delta),
            "survival_values": torch.tensor(values),
            "survival_max_len": self.survival.max_len,
            "meta": {k: v for k, v in self.meta.items() if isinstance(v, str | int | float)},
        }
        torch.save(blob, str(path))

    @classmethod
    def load(cls, path: str | Path) -> LearnedPredictor:
        """Read a model written by `save` (torch.load with weights_only: no code is run)."""
        torch = _require_torch()
        try:
            blob = torch.load(str(path), map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as exc:
            raise ValueError(f"{path}: not a remaining-length model ({exc})") from exc
        if not isinstance(blob, dict) or blob.get("format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} model file")
        if list(blob["features"]) != list(FEATURE_NAMES):
            raise ValueError(f"{path}: model features {blob['features']} differ from {list(FEATURE_NAMES)}")
        layers = [
            (w.double().numpy(), b.double().numpy()) for w, b in zip(blob["weights"], blob["biases"], strict=True)
        ]
        survival = SurvivalPredictor.from_table(
            blob["survival_values"].double().numpy(),
            delta=int(blob["survival_delta"]),
            max_len=int(blob["survival_max_len"]),
        )
        return cls(
            layers,
            mean=blob["mean"].double().numpy(),
            std=blob["std"].double().numpy(),
            scale=float(blob["scale"]),
            survival=survival,
            max_len=int(blob["max_len"]),
            meta=dict(blob.get("meta", {})),
        )


def load(path: str | Path) -> LearnedPredictor:
    """Read a model file written by `LearnedPredictor.save`."""
    return LearnedPredictor.load(path)


def split_requests(n: int, share: float, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(kept, held aside) request indices: a seeded random `share` of the n requests held aside."""
    if not 0.0 < share < 1.0:
        raise ValueError("the held-aside share must be in (0, 1)")
    order = rng.permutation(n)
    k = min(max(1, round(n * share)), n - 1)
    return np.sort(order[k:]), np.sort(order[:k])


def train(
    prompt: np.ndarray,
    output: np.ndarray,
    *,
    max_len: int | None = None,
    hidden: Sequence[int] = (64, 64),
    epochs: int = 60,
    batch_size: int = 512,
    lr: float = 1e-3,
    weight_decay: float = 1e-4,
    patience: int = 8,
    val_share: float = 0.15,
    every: int = 20,
    max_samples: int = 200_000,
    seed: int = 0,
    threads: int | None = 1,
    on_epoch: EpochCallback | None = None,
) -> tuple[LearnedPredictor, TrainReport]:
    """Train on completed requests (prompt and output lengths); returns the model and a report.

    A seeded `val_share` of the requests is kept for early stopping; Ŝ (the survival features)
    comes from the other requests only. Samples: one every `every` generated tokens, at most
    `max_samples` for training (and a proportional number for validation).
    """
    torch = _require_torch()
    started = time.perf_counter()
    prompt = np.asarray(prompt, dtype=np.int64)
    output = np.asarray(output, dtype=np.int64)
    if len(prompt) != len(output):
        raise ValueError("prompt and output lengths differ in count")
    if len(output) < 4:
        raise ValueError("training needs at least 4 requests")
    if threads is not None:
        torch.set_num_threads(max(1, threads))
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    cap = int(max_len if max_len is not None else output.max())
    tr, va = split_requests(len(output), val_share, rng)
    survival = SurvivalPredictor.from_lengths(output[tr], max_len=cap)

    def samples(idx: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        req, age, rem = residual_samples(output[idx], every=every, max_samples=limit, rng=rng)
        return features(prompt[idx][req], age, survival), age.astype(float), rem.astype(float)

    x_tr, _, y_tr = samples(tr, max_samples)
    x_va, _, y_va = samples(va, max(1000, int(max_samples * val_share / (1 - val_share))))
    mean = x_tr.mean(axis=0)
    std = x_tr.std(axis=0)
    std = np.where(std > 1e-9, std, 1.0)
    scale = max(float(np.mean(y_tr)), 1.0)

    sizes = [len(FEATURE_NAMES), *hidden, 1]
    mods: list[Any] = []
    for k in range(len(sizes) - 1):
        mods.append(torch.nn.Linear(sizes[k], sizes[k + 1]))
        if k < len(sizes) - 2:
            mods.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*mods).double()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    xt = torch.from_numpy((x_tr - mean) / std)
    yt = torch.from_numpy(y_tr / scale)
    xv = torch.from_numpy((x_va - mean) / std)
    gen = torch.Generator().manual_seed(seed)

    def val_mae() -> tuple[float, float]:
        with torch.no_grad():
            pv = model(xv)[:, 0].numpy() * scale
            pt = model(xt)[:, 0].numpy() * scale
        return float(np.mean(np.abs(pv - y_va))), float(np.mean(np.abs(pt - y_tr)))

    best = (math.inf, math.inf, 0)
    best_state = {k: v.clone() for k, v in model.state_dict().items()}
    epoch = 0
    for epoch in range(1, epochs + 1):
        model.train()
        perm = torch.randperm(len(xt), generator=gen)
        total = 0.0
        for s in range(0, len(xt), batch_size):
            b = perm[s : s + batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.l1_loss(model(xt[b])[:, 0], yt[b])
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(b)
        model.eval()
        v_mae, t_mae = val_mae()
        if on_epoch is not None:
            on_epoch(epoch, total / len(xt) * scale, v_mae)
        if v_mae < best[0]:
            best = (v_mae, t_mae, epoch)
            best_state = {k: v.clone() for k, v in model.state_dict().items()}
        elif epoch - best[2] >= patience:
            break
    model.load_state_dict(best_state)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    layers = [(m.weight.detach().numpy().copy(), m.bias.detach().numpy().copy()) for m in linears]
    predictor = LearnedPredictor(
        layers,
        mean=mean,
        std=std,
        scale=scale,
        survival=survival,
        max_len=cap,
        meta={
            "hidden": ",".join(str(h) for h in hidden),
            "best_epoch": best[2],
            "val_mae": best[0],
            "train_requests": len(tr),
            "every": every,
            "seed": seed,
        },
    )
    report = TrainReport(
        epochs=epoch,
        best_epoch=best[2],
        train_mae=best[1],
        val_mae=best[0],
        train_samples=len(y_tr),
        val_samples=len(y_va),
        train_requests=len(tr),
        val_requests=len(va),
        seconds=time.perf_counter() - started,
    )
    return predictor, report
