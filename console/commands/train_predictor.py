"""`sibyl-console train-predictor`: train the learned remaining-length predictor ARES can use."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from core.errors import ConfigError

if TYPE_CHECKING:
    import numpy as np

# numpy, rich and the trace readers load inside the command.

_AGE_BUCKETS = ((0, 1), (1, 1024), (1024, 4096), (4096, 8192), (8192, None))
"""Generated-token ranges the MAE is also reported on (prompt-only first, as in ARES Fig. 7)."""


def _read(
    traces: list[Path],
    fmt: str,
    seed: int,
    servegen_start: float,
    servegen_duration: float,
    limit: int | None,
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    import numpy as np

    from core.traces import read_trace

    prompts: list[np.ndarray] = []
    outputs: list[np.ndarray] = []
    sources: list[str] = []
    for path in traces:
        t = read_trace(
            path,
            fmt,
            seed=seed,
            servegen_start_s=servegen_start,
            servegen_duration_s=servegen_duration,
            limit=limit,
        )
        prompts.append(t.prompt_tokens)
        outputs.append(t.output_tokens)
        sources.append(f"{t.source or t.name} ({len(t)} requests)")
    return np.concatenate(prompts), np.concatenate(outputs), sources


def _mae_rows(age: np.ndarray, rem: np.ndarray, preds: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    import numpy as np

    rows: list[dict[str, Any]] = []
    for lo, hi in ((0, None), *_AGE_BUCKETS):
        sel = (age >= lo) & (age < hi if hi is not None else True)
        label = "all" if (lo, hi) == (0, None) else ("prompt only" if hi == 1 else f"{lo}-{hi or ''}")
        row: dict[str, Any] = {"generated": label, "samples": int(sel.sum())}
        for name, p in preds.items():
            row[name] = float(np.mean(np.abs(p[sel] - rem[sel]))) if sel.any() else None
        rows.append(row)
    return rows


def train_predictor(
    traces: Annotated[
        list[Path],
        typer.Argument(help="trace files or ServeGen folders with prompt and output lengths"),
    ],
    out: Annotated[Path, typer.Option("--out", help="write the model here (e.g. model.pt)")],
    format: Annotated[
        str, typer.Option("--format", help="trace format: auto|mooncake|azure|burstgpt|servegen")
    ] = "auto",
    limit: Annotated[int | None, typer.Option(min=1, help="use at most N requests per trace")] = None,
    servegen_start: Annotated[
        float, typer.Option(min=0.0, help="ServeGen: start of the sampled range, s of the day")
    ] = 0.0,
    servegen_duration: Annotated[float, typer.Option(min=1.0, help="seconds of a ServeGen folder to sample")] = 3600.0,
    holdout: Annotated[
        float, typer.Option(min=0.01, max=0.9, help="share of requests held aside for the MAE report")
    ] = 0.15,
    val_share: Annotated[
        float, typer.Option(min=0.01, max=0.9, help="share of training requests for early stopping")
    ] = 0.15,
    max_tokens: Annotated[int | None, typer.Option(min=1, help="output cap (default: the longest output seen)")] = None,
    hidden: Annotated[str, typer.Option(help="hidden layer widths, comma-separated")] = "64,64",
    epochs: Annotated[int, typer.Option(min=1, help="at most this many epochs")] = 60,
    patience: Annotated[int, typer.Option(min=1, help="stop after N epochs without improvement")] = 8,
    batch_size: Annotated[int, typer.Option(min=1)] = 512,
    lr: Annotated[float, typer.Option(min=0.0, help="AdamW learning rate")] = 1e-3,
    samples: Annotated[int, typer.Option(min=100, help="training samples (points every --every tokens)")] = 200_000,
    every: Annotated[int, typer.Option(min=1, help="one sample every N generated tokens")] = 20,
    threads: Annotated[int, typer.Option(min=1, help="torch CPU threads")] = 1,
    seed: Annotated[int, typer.Option(help="seed of the split, sampling and training")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Train the learned remaining-length predictor on traces and compare it with the survival one.

    A seeded --holdout share of the requests is held aside; the model trains on the rest (with its
    own --val-share for early stopping) and the MAE (tokens) of the learned and the survival
    predictors (fitted on the same training requests) is printed on the held-aside requests, one
    sample every --every generated tokens, overall and by tokens generated so far.

    Example: sibyl-console train-predictor ../shared/traces/servegen_deepseek_r1 --out model.pt &&
      sibyl-console sim --reschedule ares --param ares.predictor=learned --param ares.model_path=model.pt
    """
    import numpy as np
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table


    try:
        from core.predict.learned import split_requests, train
    except ImportError as exc:  # pragma: no cover
        raise ConfigError(f"train-predictor: {exc}") from exc
    try:
        import torch  # noqa: F401
    except ImportError:
        raise ConfigError(
            "train-predictor needs torch: pip install -e '.[predict]' (or make test-torch, which installs it)"
        ) from None
    from core.predict import SurvivalPredictor, residual_samples

    try:
        widths = tuple(int(x) for x in hidden.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--hidden {hidden!r}: expected comma-separated integers") from None
    if not widths or min(widths) < 1:
        raise ConfigError(f"--hidden {hidden!r}: expected positive widths")
    prompt, output, sources = _read(traces, format, seed, servegen_start, servegen_duration, limit)
    if len(output) < 20:
        raise ConfigError(f"only {len(output)} requests: too few to train and hold some aside")
    cap = int(max_tokens or output.max())
    output = np.minimum(output, cap)
    rng = np.random.default_rng(seed)
    kept, held = split_requests(len(output), holdout, rng)
    err = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        console=err,
        transient=as_json,
    ) as progress:
        task = progress.add_task("training", total=epochs, info="")

        def on_epoch(epoch: int, loss: float, val: float) -> None:
            progress.update(task, completed=epoch, info=f"L1 {loss:.0f}  val MAE {val:.0f}")

        model, report = train(
            prompt[kept],
            output[kept],
            max_len=cap,
            hidden=widths,
            epochs=epochs,
            batch_size=batch_size,
            lr=lr,
            patience=patience,
            val_share=val_share,
            every=every,
            max_samples=samples,
            seed=seed,
            threads=threads,
            on_epoch=on_epoch,
        )
        progress.update(task, completed=epochs)
    out.parent.mkdir(parents=True, exist_ok=True)
    model.meta["traces"] = "; ".join(sources)[:2000]
    model.save(out)
    survival = SurvivalPredictor.from_lengths(output[kept], max_len=cap)
    req, age, rem = residual_samples(output[held], every=every, max_samples=max(samples, 10_000), rng=rng)
    p_held = prompt[held][req]
    rem_f = rem.astype(float)
    preds = {
        "learned": model.predict(p_held, age),
        "surv_mean": survival.mean_remaining(age),
        "surv_median": survival.median_remaining(age),
        "constant": np.full(len(rem), float(np.median(output[kept]))),
    }
    rows = _mae_rows(age, rem_f, preds)
    summary = {
        "out": str(out),
        "traces": sources,
        "requests": {
            "train": int(report.train_requests),
            "validation": int(report.val_requests),
            "held_aside": len(held),
        },
        "output_cap": cap,
        "params": model.n_params,
        "epochs": report.epochs,
        "best_epoch": report.best_epoch,
        "val_mae": report.val_mae,
        "train_seconds": report.seconds,
        "held_aside_mae": rows,
    }
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
        return
    table = Table(
        title=(f"MAE (tokens) on {len(held)} held-aside requests, one sample every {every} tokens ({len(rem)} samples)")
    )
    for col in ("generated", "samples", *preds):
        table.add_column(col, justify="left" if col == "generated" else "right")
    for row in rows:
        table.add_row(
            row["generated"],
            str(row["samples"]),
            *("-" if row[k] is None else f"{row[k]:.0f}" for k in preds),
        )
    console = Console()
    console.print(table)
    overall = rows[0]
    console.print(
        f"learned {overall['learned']:.0f} vs survival {overall['surv_mean']:.0f} (mean) / "
        f"{overall['surv_median']:.0f} (median) tokens (constant: the training median output "
        f"length); {model.n_params} parameters, best "
        f"epoch {report.best_epoch} of {report.epochs}, {report.seconds:.0f} s; wrote {out}"
    )


def register(app: typer.Typer) -> None:
    app.command("train-predictor")(train_predictor)
