"""A finite gradient whose step overflows float32 (a huge lr, a gradient whose square is inf, 0/0 with eps=0)
must not put inf or NaN into trained rows or their optimizer state: the step raises InvalidRowsError, the rows
that would overflow keep their previous row and state, every other row gets torch's update, and the store
(after flush and reopen) holds only finite values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import embstore
from kernel_threads import kernel_path
from embstore.training import TieredEmbeddingBagCollection, state_dim
from embstore.training._kernels import step_rows
from embstore.training.optim import OptimConfig, apply_update, finite_rows
from embstore.training.testing import TorchReference, initial_weights, loss_of, make_store, rel_err

ROWS, DIM = 50, 4
RESIDENT = '[{ kind = "dram", capacity = "1MiB" }, { kind = "mmap" }]'
# bag 0 holds rows 1, 2 and 3; bag 1 rows 3, 4 and 5 (row 3 gets both bags' gradients)
IDS, OFFS = torch.tensor([1, 2, 3, 4, 3, 5]), torch.tensor([0, 3, 6])
# (optimizer, lr, eps, loss weight of bag 0, of bag 1): loss = sum(pooled^2 * weight), so a row's gradient is
# about 2 * 0.3 * weight. sgd: lr * 600 overflows; the adagrads: g * g does (g ~ 6e20); adam: (1 - b2) * g * g;
# eps = 0: the rows of a bag with a zero gradient get 0 / 0.
CASES = [("sgd", 1e38, None, 1e3, 1e-3), ("adagrad", 0.1, None, 1e21, 1.0),
         ("rowwise_adagrad", 0.1, None, 1e21, 1.0), ("adam", 0.01, None, 1e24, 1.0),
         ("rowwise_adagrad", 0.1, 0.0, 1.0, 0.0), ("adagrad", 0.1, 0.0, 1.0, 0.0)]
IDS_OF_CASES = ["sgd-lr-1e38", "adagrad-g2", "rowwise-g2", "adam-g2", "rowwise-eps0", "adagrad-eps0"]


def cached_tiers(optimizer: str) -> str:
    """An LRU DRAM cache of 10 rows over an ssd home: training goes through a working set, not in place."""
    row_bytes = 4 * (DIM + state_dim(optimizer, DIM))
    return f'[{{ kind = "dram", capacity = {10 * row_bytes}, policy = "lru" }}, {{ kind = "ssd" }}]'


def read_all(store: embstore.Store, name: str = "a") -> tuple[np.ndarray, np.ndarray]:
    t = store[name]
    return t.read_with_state(np.arange(t.num_rows, dtype=np.int64))


def torch_bad_rows(ref: TorchReference, optimizer: str, adam_step: str) -> np.ndarray:
    """Rows torch's own optimizer (fbgemm's for rowwise) left with a non-finite value in the row or its state."""
    bad = ~np.isfinite(ref.weights()[0]).all(axis=1)
    if optimizer == "adagrad":
        states = [ref.opt.state[ref.bags[0].weight]["sum"]]
    elif optimizer == "adam" and adam_step == "global":
        st = ref.opt.state[ref.bags[0].weight]
        states = [st["exp_avg"], st["exp_avg_sq"]]
    elif optimizer == "adam":
        states = [ref.state[0]["m"], ref.state[0]["v"]]
    elif optimizer == "rowwise_adagrad":
        states = [ref.tbe[0].split_optimizer_states()[0][0][:, None]]
    else:
        states = []
    for s in states:
        bad |= ~np.isfinite(s.detach().numpy()).all(axis=1)
    return bad


@pytest.mark.parametrize("parallel", [False, True], ids=["one-thread", "parallel"])
@pytest.mark.parametrize("tiers", ["resident", "cached"])
@pytest.mark.parametrize("optimizer,lr,eps,huge,small", CASES, ids=IDS_OF_CASES)
def test_an_overflowing_step_raises_and_leaves_only_finite_rows(tmp_path, optimizer, lr, eps, huge, small, tiers,
                                                                parallel) -> None:
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], RESIDENT if tiers == "resident" else cached_tiers(optimizer))
    init = initial_weights(store, "a")
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer=optimizer, lr=lr, eps=eps)
    ref = TorchReference([init], optimizer, lr, eps=eps)
    weights = torch.tensor([huge, small], dtype=torch.float32)[:, None, None].expand(2, 1, DIM).contiguous()
    with kernel_path(parallel):
        out = ebc([IDS], [OFFS])
        with pytest.raises(embstore.InvalidRowsError, match=rf"table 'a': the {optimizer} step would have written "
                                                             r"inf or NaN .* into \d+ of its 5 rows.*Lower the "
                                                             r"learning rate") as caught:
            loss_of(out, weights).backward()
    assert ("pass eps > 0" in str(caught.value)) == (eps == 0.0)  # 0 / 0 is not cured by a lower lr
    ref.step([IDS], [OFFS], weights)
    bad = torch_bad_rows(ref, optimizer, "row")
    assert 0 < bad.sum() < 5  # the case overflows some rows of the batch, not all
    ebc.flush()
    rows, state = read_all(store)
    np.testing.assert_array_equal(rows[bad], init[bad])  # an overflowing row keeps its row and (zero) state
    assert not state[bad].any()
    assert rel_err(rows[~bad], ref.weights()[0][~bad]) <= 1e-5  # the others got torch's step
    assert np.isfinite(state).all()

    ebc.release()
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer=optimizer, lr=0.01)  # the fix the error names
    with kernel_path(parallel):
        loss_of(ebc([IDS], [OFFS]), torch.ones_like(weights)).backward()
    ebc.release()
    path = store.path
    store.close()
    with embstore.open(path) as again:
        rows, state = read_all(again)
        assert np.isfinite(rows).all() and np.isfinite(state).all()
        assert not np.array_equal(rows[bad], init[bad])  # the rows skipped before trained now


@pytest.mark.parametrize("adam_step", ["row", "global"])
def test_adam_overflow_keeps_the_step_count(tmp_path, adam_step: str) -> None:
    """Adam's row step count is state too: an overflowing row does not count the step it did not take."""
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], RESIDENT)
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="adam", lr=0.01, adam_step=adam_step)
    weights = torch.tensor([1e24, 1.0])[:, None, None].expand(2, 1, DIM).contiguous()
    with pytest.raises(embstore.InvalidRowsError, match="inf or NaN"):
        loss_of(ebc([IDS], [OFFS]), weights).backward()
    ebc.flush()
    _, state = read_all(store)
    np.testing.assert_array_equal(state[[1, 2, 3], 2 * DIM], 0.0)  # bag 0's rows (and row 3, in both bags)
    np.testing.assert_array_equal(state[[4, 5], 2 * DIM], 1.0)
    store.close()


def test_a_qr_hashed_table_does_not_store_an_overflow(tmp_path) -> None:
    """QR tables step unique physical rows with ``step_rows`` (not the fused bag kernel)."""
    store = make_store(tmp_path / "s", [("q", 1000, DIM)], RESIDENT, extra='hash = { kind = "qr", collisions = 8 }\n')
    before, _ = read_all(store, "q")
    ebc = TieredEmbeddingBagCollection(store, ["q"], optimizer="sgd", lr=1e38)
    out = ebc([torch.tensor([7, 123, 4567])], [torch.tensor([0, 2, 3])])
    with pytest.raises(embstore.InvalidRowsError, match="table 'q': the sgd step would have written inf"):
        (out * 1e6).sum().backward()
    ebc.release()
    after, _ = read_all(store, "q")
    assert np.isfinite(after).all()
    np.testing.assert_array_equal(after, before)  # every touched row overflowed: none moved
    store.close()


@pytest.mark.parametrize("optimizer,scale", [("sgd", 1e3), ("adagrad", 1e21), ("rowwise_adagrad", 1e21),
                                             ("adam", 1e24)])
def test_the_accelerator_path_keeps_the_rows_the_kernel_keeps(optimizer: str, scale: float) -> None:
    """Tables on an accelerator step with ``apply_update`` on gathered copies, then store only the rows
    ``finite_rows`` passes; on the CPU that must leave the same rows as the fused kernel does."""
    rng = np.random.default_rng(3)
    n, sd = 64, state_dim(optimizer, DIM)
    rows = rng.uniform(-0.1, 0.1, (n, DIM)).astype(np.float32)
    state = np.zeros((n, sd), np.float32)
    g = (rng.standard_normal((n, DIM)) * np.where(rng.random(n) < 0.5, scale, 1.0)[:, None]).astype(np.float32)
    lr = 1e38 if optimizer == "sgd" else 0.01
    cfg = OptimConfig(optimizer, lr, {"sgd": 0.0, "adam": 1e-8}.get(optimizer, 1e-10))
    w, s = torch.from_numpy(rows.copy()), torch.from_numpy(state.copy())
    apply_update(cfg, w, s, torch.from_numpy(g), 1)
    ok = finite_rows(w, s).numpy()
    want_rows, want_state = np.where(ok[:, None], w.numpy(), rows), np.where(ok[:, None], s.numpy(), state)
    kind = {"sgd": 0, "rowwise_adagrad": 1, "adagrad": 2, "adam": 3}[optimizer]
    bad = step_rows(kind, rows, state, np.arange(n), g, cfg.lr, cfg.eps, cfg.beta1, cfg.beta2, 0.0, 0, 1)
    assert 0 < bad == int((~ok).sum()) < n
    assert rel_err(rows, want_rows) <= 1e-5 and (sd == 0 or rel_err(state, want_state) <= 1e-5)
    assert np.isfinite(rows).all() and np.isfinite(state).all()


_T = 2.0**128 - 2.0**103  # the smallest magnitude that rounds to inf in float32
_BIG = [3.4028234e38, 3.0e38, 1.0, 0.0]
_LR = [0.5, 1e10, 1e20, 1e29, 1e30, 3e30, 1e31, 3e31, 1e32]
_G = [1e-3, 1.0, 3.0, 1e9, 1e10, 1e11, 1e19]


@settings(max_examples=80, deadline=None)
@given(kind=st.sampled_from([0, 1]), lr=st.sampled_from(_LR),
       data=st.lists(st.tuples(st.lists(st.sampled_from(_BIG), min_size=DIM, max_size=DIM),
                               st.lists(st.sampled_from([-1, 1]), min_size=DIM, max_size=DIM),
                               st.lists(st.sampled_from([-1, 1]), min_size=DIM, max_size=DIM),
                               st.sampled_from(_G)), min_size=1, max_size=8))
def test_rows_near_the_float32_limit_overflow_exactly_when_float64_says_so(kind, lr, data) -> None:
    """sgd and rowwise Adagrad take a one-pass path when a scalar bound (1e30) says no finite row can
    overflow, and check element by element otherwise: for rows at +-FLT_MAX and steps (sgd: lr * g;
    rowwise: about lr) on both sides of the bound, a row is updated exactly when its new values, computed
    in float64, round to finite float32; otherwise it keeps its row and state."""
    n = len(data)
    rows = np.array([np.multiply(vals, signs) for vals, signs, _, _ in data], np.float32)
    g = np.array([np.multiply(scale, signs) for _, _, signs, scale in data], np.float32)
    state = np.zeros((n, 1 if kind else 0), np.float32)
    old = rows.copy()
    g64 = g.astype(np.float64)
    if kind == 0:
        new = old - lr * g64
        state_ok = np.ones(n, bool)
    else:
        squares = (g64 * g64).sum(axis=1)  # summed in float32 before the mean, as fbgemm does
        assume(not (np.abs(squares - _T) < 1e-5 * _T).any())
        total = squares / DIM  # the state starts at 0
        new = old - (lr / (np.sqrt(total) + 1e-8))[:, None] * g64
        state_ok = squares < _T
    mag = np.abs(new)
    assume(not (np.abs(mag - _T) < 1e29).any())  # float32 rounding of the step itself could tip these
    ok = state_ok & (mag < _T).all(axis=1)
    skipped = step_rows(kind, rows, state, np.arange(n), g, lr, 1e-8, 0.9, 0.999, 0.0, 0, 1)
    assert skipped == int((~ok).sum())
    np.testing.assert_array_equal(rows[~ok], old[~ok])
    scale = np.abs(old.astype(np.float64)) + np.abs(old - new)  # the terms, for the cancellation's error
    assert (np.abs(rows[ok] - new[ok]) <= 1e-6 * scale[ok]).all()
    assert np.isfinite(rows).all() and np.isfinite(state).all()


@pytest.mark.parametrize("optimizer", ["sgd", "rowwise_adagrad", "adagrad", "adam"])
def test_a_float16_table_refuses_a_step_beyond_float16_and_keeps_training(tmp_path, optimizer: str) -> None:
    """A float16 table stores |x| <= 65504. A step that takes rows past that (finite in float32) used to be
    stored in the working set, then refused at every write-back: each later step and every flush raised,
    and the row drifted further on each step. Now such rows keep their row and state, the step raises
    naming float16, the other rows are updated, and flush and later steps work."""
    store = make_store(tmp_path / "s", [("a", ROWS, DIM)], cached_tiers(optimizer),
                       extra='dtype = "float16"\n')
    sgd = optimizer == "sgd"  # sgd: bag 0's rows step by 1e6, bag 1's by 1e-3; the others step by ~lr
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer=optimizer, lr=1.0 if sgd else 1e5)
    before_rows, before_state = read_all(store)
    weights = torch.tensor([1e6, 1e-3 if sgd else 0.0])[:, None, None].expand(2, 1, DIM).contiguous()
    with pytest.raises(embstore.InvalidRowsError, match=r"float16's range .* into \d+ of its 5 rows"):
        (ebc([IDS], [OFFS]) * weights).sum().backward()
    ebc.flush()  # refused forever before the fix
    rows, state = read_all(store)
    bad = np.isin(np.arange(ROWS), [1, 2, 3])  # bag 0's rows (row 3 is in both bags)
    np.testing.assert_array_equal(rows[bad], before_rows[bad])
    np.testing.assert_array_equal(state[bad], before_state[bad])
    if sgd:  # bag 1's rows 4 and 5 took their step, rounded to float16
        want = (before_rows[[4, 5]] - 1e-3).astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(rows[[4, 5]], want)
    np.testing.assert_array_equal(rows[~np.isin(np.arange(ROWS), IDS.numpy())], before_rows[~np.isin(
        np.arange(ROWS), IDS.numpy())])
    ebc.release()
    ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer=optimizer, lr=0.01)  # the fix the error names
    ebc([IDS], [OFFS]).sum().backward()  # trains every row again
    ebc.release()
    rows, _ = read_all(store)
    assert np.isfinite(rows).all() and np.abs(rows).max() <= 65504
    assert not np.array_equal(rows[bad], before_rows[bad])
    store.close()


def test_the_accelerator_path_keeps_float16_rows_in_range() -> None:
    """On an accelerator a float16 table's step stores only the rows ``finite_rows(w, s, limit)`` passes:
    finite, and every value of magnitude below 65520 (what float16 rounds to inf)."""
    from embstore.rows import FLOAT16_LIMIT

    w = torch.tensor([[1.0, -65504.0], [65519.0, 0.0], [0.0, -65520.0], [float("inf"), 0.0], [1e6, 1.0]])
    s = torch.tensor([[0.0], [1e30], [0.0], [0.0], [0.0]])
    assert finite_rows(w, s).tolist() == [True, True, True, False, True]
    assert finite_rows(w, s, FLOAT16_LIMIT).tolist() == [True, True, False, False, False]
    s[0, 0] = float("nan")
    assert finite_rows(w, s, FLOAT16_LIMIT).tolist() == [False, True, False, False, False]
