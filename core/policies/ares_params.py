"""Parameters of the ARES rebalancing policies (core/policies/ares.py): round, horizon and predictor."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from core.policies.base import PeriodicParams


class RoundParams(PeriodicParams):
    """Params every rebalancing round has."""

    period_s: float = Field(1.0, gt=0, description="seconds between two rounds (the paper: every 1 s)")
    theta: float = Field(
        0.1,
        ge=0.0,
        le=10.0,
        description="imbalance threshold θ: overloaded when w_i > (1+θ)·mean w (not in the paper)",
    )
    underload: Literal["literal", "strict"] = Field(
        "literal",
        description=(
            "underloaded targets: literal — current load N_i(0) < (1+θ)·mean w, as Algorithm 1 "
            "reads; strict — not overloaded and w_i < (1−θ)·mean w"
        ),
    )
    kv_margin: float = Field(
        0.05,
        ge=0.0,
        lt=1.0,
        description="OOM filter keeps the target's load within (1 − margin)·KV capacity",
    )
    max_moves: int = Field(
        1,
        ge=1,
        le=1024,
        description=(
            "migrations per round (the paper: 1); more are chosen greedily on updated loads, "
            "each instance in at most one of them"
        ),
    )
    cooldown_s: float = Field(10.0, ge=0.0, description="seconds a migrated request rests before it may move again")


class CurrentLoadParams(RoundParams):
    """Params of the rebalancing round on current loads (`current_load`)."""

    selection: Literal["gain", "fewest_tokens", "most_tokens"] = Field(
        "gain",
        description=(
            "which move among those that reduce the variance: gain — the largest reduction "
            "(the paper); fewest_tokens — the cheapest transfer first (Llumnix-style); "
            "most_tokens — the largest request first"
        ),
    )


class HorizonParams(RoundParams):
    """Params of a round that weighs a horizon of predicted loads (`ares`, `ares_oracle`)."""

    horizon_steps: int = Field(100, ge=1, le=5000, description="H: future time steps weighed (spec proposal: 100)")
    step_tokens: int = Field(
        20,
        ge=1,
        le=100_000,
        description="Δ: decode iterations per horizon step (= tokens per request; spec: 20)",
    )
    gamma: float = Field(0.97, gt=0.0, le=1.0, description="β_t ∝ γ^t, normalised to sum 1 over t = 1..H")
    oom_check: Literal["horizon", "literal"] = Field(
        "horizon",
        description=(
            "horizon — max over the horizon of the target's predicted load plus the request's "
            "trajectory within (1 − kv_margin)·capacity; literal — current target load + N̂(r) "
            "≤ capacity, as Algorithm 1 reads"
        ),
    )
    worth_filter: bool = Field(
        True,
        description="keep only requests predicted to outlive their transfer (N̂ > C_mig/T_exec)",
    )


class AresOracleParams(HorizonParams):
    """ARES with the true remaining length (simulator only): point trajectories."""

    selection: Literal["gain", "shortest_remaining", "longest_remaining", "fewest_tokens", "most_tokens"] = Field(
        "gain",
        description=(
            "which move among those that reduce the variance: gain — the largest reduction "
            "(the paper); shortest_remaining / longest_remaining — by predicted remaining "
            "tokens; fewest_tokens — the cheapest transfer first (Llumnix-style); most_tokens — "
            "the largest request first"
        ),
    )


class AresParams(AresOracleParams):  # `ares`: remaining lengths from a predictor (no docstring: none in its schema)
    predictor: Literal["survival", "learned"] = Field(
        "survival",
        description=(
            "survival — residual life from the dispatcher's output-length survival estimator "
            "(no engine plugin needed); learned — the MLP of `train-predictor` (model_path)"
        ),
    )
    model_path: str | None = Field(
        None, description="learned predictor model file (from `sibyl-console train-predictor`)"
    )
    survival_statistic: Literal["mean", "median"] = Field(
        "mean",
        description="survival point prediction: mean or median residual life",
    )
    trajectory: Literal["auto", "expected", "point"] = Field(
        "auto",
        description=(
            "future tokens of a request: point — N + tΔ until its predicted end; expected — "
            "weighted by the survival probability of each step; auto — expected with the "
            "survival predictor, point with the learned one"
        ),
    )

    @model_validator(mode="after")
    def _model_needed(self) -> AresParams:
        if self.predictor == "learned" and not self.model_path:
            raise ValueError("predictor=learned needs model_path")
        return self
