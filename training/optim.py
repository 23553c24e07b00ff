"""Row-wise optimizers applied to a batch's unique rows (fused into backward).

State layout per physical row (float32 columns stored beside the row in the
store, so one tier read/write moves both)::

    sgd              0 columns
    rowwise_adagrad  1 column : sum over steps of mean(g^2)      (fbgemm EXACT_ROWWISE_ADAGRAD)
    adagrad          dim      : sum over steps of g^2            (torch.optim.Adagrad, sparse grads)
    adam             2*dim+1  : m, v, and the row's own step count

Adam's bias correction uses the *row's* step count (how many batches updated
that row), not a global step as ``torch.optim.Adam``/``SparseAdam`` do: a row
first seen at step 10_000 starts from m = v = 0 and is corrected as a fresh
row. ``adam_step="global"`` uses the module's step count instead, which is
exactly ``torch.optim.SparseAdam``. The step count is a float32 column, exact
up to 2^24 updates of one row.

Weight decay is L2 added to the gradient of the rows in the batch only (rows
not in the batch do not move, as with sparse gradients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from embstore.errors import InvalidInputError, InvalidRowsError

OPTIMIZERS = ("sgd", "rowwise_adagrad", "adagrad", "adam")
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)
DEFAULT_EPS = {"sgd": 0.0, "rowwise_adagrad": 1e-8, "adagrad": 1e-10, "adam": 1e-8}


def state_dim(optimizer: str, dim: int) -> int:
    """Float32 optimizer-state columns per row of physical width ``dim``."""
    return {"sgd": 0, "rowwise_adagrad": 1, "adagrad": dim, "adam": 2 * dim + 1}[check_optimizer(optimizer)]


def check_optimizer(name: str) -> str:
    if name not in OPTIMIZERS:
        raise InvalidInputError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {name!r}")
    return name


def check_hyperparameters(lr: float, eps: float | None, betas: tuple[float, float], weight_decay: float) -> None:
    """Refuse values that would quietly wreck every row trained: a NaN, a negative step, betas outside [0, 1),
    a value past float32's range (the kernels step in float32, where it is inf and turns every row it touches
    into inf or NaN)."""
    def number(name: str, value: object, low: float, high: float = _FLOAT32_MAX, high_open: bool = False) -> None:
        try:
            x = float(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise InvalidInputError(f"{name} must be a number, got {value!r}") from None
        if not math.isfinite(x) or not (low <= x < high if high_open else low <= x <= high):
            where = f"in [{low:g}, {high:g})" if high_open else f"in [{low:g}, {high:g}] (float32)"
            raise InvalidInputError(f"{name} must be a finite number {where}, got {value!r}")

    number("lr", lr, 0.0)
    if eps is not None:
        number("eps", eps, 0.0)
    number("weight_decay", weight_decay, 0.0)
    try:
        betas = tuple(betas)
    except TypeError:
        raise InvalidInputError(f"betas must be two numbers, got {betas!r}") from None
    if len(betas) != 2:
        raise InvalidInputError(f"betas must be two numbers, got {betas!r}")
    number("betas[0]", betas[0], 0.0, 1.0, high_open=True)
    number("betas[1]", betas[1], 0.0, 1.0, high_open=True)


def check_finite_gradient(grad: torch.Tensor, table: str) -> None:
    """Raise before a NaN or inf gradient reaches the rows: the fused step would write it into the store,
    where it outlives the batch (torch's own optimizers would at least leave the checkpoint intact)."""
    if math.isfinite(float(grad.sum())):  # one reduction; any NaN or inf makes the sum non-finite
        return
    bad = int((~torch.isfinite(grad)).sum())
    if bad == 0:  # finite values whose sum overflowed
        return
    raise InvalidRowsError(f"table {table!r}: the gradient holds {bad} NaN or inf values; its rows were not "
                           "updated (look for a NaN loss or an overflow in the model)")


def finite_rows(w: torch.Tensor, s: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """Mask of the rows whose new values ``w`` (n, d) and state ``s`` (n, state_dim) are all finite, and
    (``limit``: a float16 table's) whose values are all below ``limit`` in magnitude: the accelerator path
    stores only these, as the CPU kernels (``_kernels._apply_row``) and ``ebc._step_table`` do."""
    ok = torch.isfinite(w).all(dim=1) & torch.isfinite(s).all(dim=1)
    return ok if limit is None else ok & (w.abs() < limit).all(dim=1)


def overflow_error(table: str, cfg: OptimConfig, skipped: int, total: int, float16: bool = False) -> InvalidRowsError:
    """The error of a step that would have written inf or NaN (from finite gradients) into ``skipped`` rows,
    or (``float16``) values a float16 table cannot hold."""
    eps_hint = ""
    if cfg.eps == 0.0 and cfg.name != "sgd":
        eps_hint = "; with eps=0 a row whose gradient is 0 divides 0 by 0: pass eps > 0"
    what = ("inf or NaN (a float32 overflow from a finite gradient)" if not float16 else
            "inf or NaN, or values beyond float16's range (|x| < 65520) of this float16 table,")
    return InvalidRowsError(
        f"table {table!r}: the {cfg.name} step would have written {what} into {skipped} of its {total} rows or "
        f"their optimizer state; those rows keep their previous values and state, the batch's other rows were "
        f"updated. Lower the learning rate (lr={cfg.lr:g}) or clip or scale down the gradients reaching the "
        f"embeddings{eps_hint}")


@dataclass
class OptimConfig:
    """Hyper-parameters; part of the module's state_dict."""

    name: str = "sgd"
    lr: float = 0.01
    eps: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    weight_decay: float = 0.0
    adam_step: str = "row"  # "row" | "global"


@torch.no_grad()
def apply_update(cfg: OptimConfig, w: torch.Tensor, s: torch.Tensor, g: torch.Tensor, global_step: int) -> None:
    """Update rows ``w`` (n, d) and their state ``s`` (n, state_dim) in place from the summed gradient ``g``."""
    if cfg.weight_decay:
        g = g.add(w, alpha=cfg.weight_decay)
    lr = cfg.lr
    if cfg.name == "sgd":
        w.add_(g, alpha=-lr)
    elif cfg.name == "rowwise_adagrad":
        s[:, 0].add_(g.square().mean(dim=1))
        mult = lr / (s[:, :1].sqrt() + cfg.eps)
        w.sub_(g * mult)
    elif cfg.name == "adagrad":
        s.addcmul_(g, g)
        w.addcdiv_(g, s.sqrt().add_(cfg.eps), value=-lr)
    else:
        d = w.shape[1]
        m, v, t = s[:, :d], s[:, d:2 * d], s[:, 2 * d:]
        t.add_(1.0)
        m.mul_(cfg.beta1).add_(g, alpha=1.0 - cfg.beta1)
        v.mul_(cfg.beta2).addcmul_(g, g, value=1.0 - cfg.beta2)
        denom = v.sqrt().add_(cfg.eps)
        if cfg.adam_step == "global":
            bc1 = 1.0 - cfg.beta1 ** global_step
            bc2 = 1.0 - cfg.beta2 ** global_step
            w.addcdiv_(m, denom, value=-lr * math.sqrt(bc2) / bc1)
        else:
            tt = t.double()
            step = (lr * torch.sqrt(1.0 - cfg.beta2 ** tt) / (1.0 - cfg.beta1 ** tt)).to(w.dtype)
            w.sub_(step * m / denom)
