"""Click-model metrics: AUC, log loss and normalised entropy (NE), all vectorised numpy.

NE (He et al., "Practical lessons from predicting clicks on ads at Facebook")
is the log loss divided by the entropy of the base click rate: below 1 means
the model beats always predicting the average rate. With labels of one class
only that entropy is 0 and NE is undefined: NaN, like AUC there (the clamped
rate made it a finite ~1e6, which read as a model far worse than guessing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from embstore.errors import InvalidInputError

EPS = 1e-7


def _check(labels: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(labels, dtype=np.float64).ravel()
    s = np.asarray(scores, dtype=np.float64).ravel()
    if y.shape != s.shape or len(y) == 0:
        raise InvalidInputError(f"labels and scores need the same non-zero length, got {len(y)} and {len(s)}")
    if not np.isin(y, (0.0, 1.0)).all():
        raise InvalidInputError("labels must be 0 or 1")
    return y, s


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC by ranks (Mann-Whitney U): tied scores share their average rank. NaN when one class is absent."""
    y, s = _check(labels, scores)
    pos = y.sum()
    neg = len(y) - pos
    if pos == 0 or neg == 0 or np.isnan(s).any():  # a NaN score has no rank (argsort put it last: a number)
        return float("nan")
    order = np.argsort(s, kind="stable")
    ss = s[order]
    starts = np.flatnonzero(np.concatenate([[True], ss[1:] != ss[:-1]]))
    ends = np.concatenate([starts[1:], [len(ss)]])
    avg_rank = (starts + ends + 1) / 2.0  # 1-based average rank of each tie group
    ranks = np.empty(len(s))
    ranks[order] = np.repeat(avg_rank, ends - starts)
    return float((ranks[y == 1].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def log_loss(labels: np.ndarray, probs: np.ndarray) -> float:
    """Mean binary cross-entropy of probabilities (clipped to [EPS, 1 - EPS])."""
    y, p = _check(labels, probs)
    p = np.clip(p, EPS, 1 - EPS)
    return float(-(y * np.log(p) + (1 - y) * np.log1p(-p)).mean())


def log_loss_logits(labels: np.ndarray, logits: np.ndarray) -> float:
    """Mean binary cross-entropy from logits, computed stably (softplus)."""
    y, z = _check(labels, logits)
    # softplus(-z) for a click, softplus(z) for none: exact for z = +-inf too (softplus(z) - y * z was inf - inf)
    return float(np.where(y == 1, np.logaddexp(0.0, -z), np.logaddexp(0.0, z)).mean())


def entropy(rate: float) -> float:
    """Binary entropy (nats) of a click rate."""
    p = min(max(rate, EPS), 1 - EPS)
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))


def _ne(log_loss_value: float, ctr: float) -> float:
    """NE from a log loss and the base rate: NaN for one class (a base entropy of 0)."""
    return float("nan") if ctr in (0.0, 1.0) else log_loss_value / entropy(ctr)


def normalized_entropy(labels: np.ndarray, probs: np.ndarray) -> float:
    """Log loss / entropy of the base rate (mean label); NaN when the labels are all one class."""
    y, _ = _check(labels, probs)
    return _ne(log_loss(labels, probs), float(y.mean()))


@dataclass(frozen=True)
class EvalResult:
    """Metrics over one held-out pass."""

    auc: float
    log_loss: float
    ne: float
    samples: int
    ctr: float


def evaluate(labels: np.ndarray, logits: np.ndarray) -> EvalResult:
    """All metrics from labels and raw logits."""
    y, z = _check(labels, logits)
    ll = log_loss_logits(y, z)
    # AUC of the logits: sigmoid is monotonic, but saturates (z > 37 all become 1.0), making false ties
    return EvalResult(auc(y, z), ll, _ne(ll, float(y.mean())), len(y), float(y.mean()))


__all__ = ["EvalResult", "auc", "entropy", "evaluate", "log_loss", "log_loss_logits", "normalized_entropy"]
