"""Remaining-output-length predictors for decode rescheduling (ARES): survival-based and learned.

`SurvivalPredictor` shares SIBYL's output-length survival estimator and needs nothing else;
`LearnedPredictor` (core.predict.learned) is a small MLP whose training and model files need the
optional torch extra; core imports without it.
"""

from core.predict.features import FEATURE_NAMES, features, residual_samples
from core.predict.learned import LearnedPredictor, TrainReport, load, split_requests, train
from core.predict.survival import SurvivalPredictor

__all__ = [
    "FEATURE_NAMES",
    "LearnedPredictor",
    "SurvivalPredictor",
    "TrainReport",
    "features",
    "load",
    "residual_samples",
    "split_requests",
    "train",
]
