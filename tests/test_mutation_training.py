"""The optimizer steps against a float64 numpy reference of the formulas in ``training/optim.py``, with
weight decay (session 10 mutation audit: no test set ``weight_decay``, so its sign or its absence from the
fused kernel went unnoticed, and ``apply_update``, the step on accelerator devices, was never run on CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embstore.training._kernels import fused_bag_step, step_rows
from embstore.training.optim import OptimConfig, apply_update, state_dim

KIND = {"sgd": 0, "rowwise_adagrad": 1, "adagrad": 2, "adam": 3}
CASES = [("sgd", "row"), ("rowwise_adagrad", "row"), ("adagrad", "row"), ("adam", "row"), ("adam", "global")]
LR, B1, B2, WD = 0.05, 0.9, 0.999, 0.1
ROWS, DIM, STEPS = 12, 5, 4
# eps far above the defaults (1e-8, 1e-10), which vanish beside sqrt(state): where eps sits shows
EPS = {"sgd": 0.0, "rowwise_adagrad": 0.01, "adagrad": 0.01, "adam": 0.01}


def ref_step(name: str, w: np.ndarray, s: np.ndarray, g: np.ndarray, adam_step: str, global_step: int,
             wd: float = WD) -> None:
    """One step on rows ``w`` and state ``s`` (float64, in place) from their summed gradient ``g``."""
    eps = EPS[name]
    g = g + wd * w  # L2 on the rows in the batch
    if name == "sgd":
        w -= LR * g
    elif name == "rowwise_adagrad":
        s[:, 0] += (g * g).mean(axis=1)
        w -= LR * g / (np.sqrt(s[:, :1]) + eps)
    elif name == "adagrad":
        s += g * g
        w -= LR * g / (np.sqrt(s) + eps)
    else:
        d = w.shape[1]
        s[:, 2 * d] += 1.0
        s[:, :d] = B1 * s[:, :d] + (1 - B1) * g
        s[:, d:2 * d] = B2 * s[:, d:2 * d] + (1 - B2) * g * g
        t = s[:, 2 * d:] if adam_step == "row" else float(global_step)
        step = LR * np.sqrt(1 - B2 ** t) / (1 - B1 ** t)
        w -= step * s[:, :d] / (np.sqrt(s[:, d:2 * d]) + eps)


def start(name: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    return rng.normal(0, 0.5, (ROWS, DIM)).astype(np.float32), np.zeros((ROWS, state_dim(name, DIM)), np.float32)


def batches(seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, offsets) per step: bags with repeated ids, rows that skip steps (row vs global Adam step)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        lengths = rng.integers(0, 5, size=4)
        ids = rng.integers(0, ROWS // 2 if len(out) % 2 else ROWS, size=int(lengths.sum()))
        out.append((ids.astype(np.int64), np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)))
    return out


def row_gradients(ids: np.ndarray, offsets: np.ndarray, grad_out: np.ndarray, mean: bool):
    """(unique rows, their inverse, each unique row's summed gradient in float64)."""
    uniq, inv = np.unique(ids, return_inverse=True)
    g = np.zeros((len(uniq), grad_out.shape[1]))
    for b in range(len(offsets) - 1):
        lo, hi = offsets[b], offsets[b + 1]
        for j in range(lo, hi):
            g[inv[j]] += grad_out[b] / ((hi - lo) if mean else 1)
    return uniq, inv, g


@pytest.mark.parametrize("name,adam_step", CASES)
@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
@pytest.mark.parametrize("parts", [1, 3])
def test_fused_bag_step_matches_the_reference_with_weight_decay(name: str, adam_step: str, mean: bool,
                                                                parts: int) -> None:
    w, s = start(name)
    ref_w, ref_s = w.astype(np.float64), s.astype(np.float64)
    rng = np.random.default_rng(3)
    for step, (ids, offsets) in enumerate(batches(11), start=1):
        grad_out = rng.normal(0, 1, (len(offsets) - 1, DIM)).astype(np.float32)
        uniq, inv, g = row_gradients(ids, offsets, grad_out, mean)
        fused_bag_step(KIND[name], w, s, uniq, inv.astype(np.int64), offsets, grad_out, mean, LR,
                       EPS[name], B1, B2, WD, step if adam_step == "global" else 0, parts)
        rw, rs = ref_w[uniq], ref_s[uniq]
        ref_step(name, rw, rs, g, adam_step, step)
        ref_w[uniq], ref_s[uniq] = rw, rs
        np.testing.assert_allclose(w, ref_w, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(s, ref_s, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name,adam_step", CASES)
@pytest.mark.parametrize("parts", [1, 3])
def test_step_rows_matches_the_reference_with_weight_decay(name: str, adam_step: str, parts: int) -> None:
    w, s = start(name)
    ref_w, ref_s = w.astype(np.float64), s.astype(np.float64)
    rng = np.random.default_rng(5)
    for step, (ids, _) in enumerate(batches(13), start=1):
        uniq = np.unique(ids)
        g = rng.normal(0, 1, (len(uniq), DIM)).astype(np.float32)
        step_rows(KIND[name], w, s, uniq, g, LR, EPS[name], B1, B2, WD,
                  step if adam_step == "global" else 0, parts)
        rw, rs = ref_w[uniq], ref_s[uniq]
        ref_step(name, rw, rs, g.astype(np.float64), adam_step, step)
        ref_w[uniq], ref_s[uniq] = rw, rs
        np.testing.assert_allclose(w, ref_w, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(s, ref_s, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name,adam_step", CASES)
@pytest.mark.parametrize("wd", [0.0, WD])
def test_apply_update_matches_the_reference(name: str, adam_step: str, wd: float) -> None:
    """The torch step the module runs on accelerator devices, here on CPU tensors."""
    cfg = OptimConfig(name, LR, EPS[name], B1, B2, wd, adam_step)
    w, s = start(name)
    ref_w, ref_s = w.astype(np.float64), s.astype(np.float64)
    tw, ts = torch.from_numpy(w.copy()), torch.from_numpy(s.copy())
    rng = np.random.default_rng(9)
    for step, (ids, _) in enumerate(batches(17), start=1):
        uniq = np.unique(ids)
        g = rng.normal(0, 1, (len(uniq), DIM)).astype(np.float32)
        idx = torch.from_numpy(uniq)
        rows, state = tw[idx], ts[idx]
        apply_update(cfg, rows, state, torch.from_numpy(g), step)
        tw[idx], ts[idx] = rows, state
        rw, rs = ref_w[uniq], ref_s[uniq]
        ref_step(name, rw, rs, g.astype(np.float64), adam_step, step, wd)
        ref_w[uniq], ref_s[uniq] = rw, rs
        np.testing.assert_allclose(tw.numpy(), ref_w, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(ts.numpy(), ref_s, rtol=1e-4, atol=1e-6)
