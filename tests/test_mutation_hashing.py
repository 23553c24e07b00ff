"""``LearnedHash.load`` refusing mapping files whose checksums hold but whose content is impossible
(session 10 mutation audit: accepting a row equal to the first reserved row, or an id table with no
empty slot, on which a lookup of an unseen id would probe forever, passed every existing test)."""

from __future__ import annotations

import numpy as np
import pytest

from embstore.errors import CorruptStoreError
from embstore.hashing import LearnedHash, ModHash
from embstore.hashing._cluster import _direction, balanced_bisect
from embstore.hashing._embed import contexts, cooccurrence_vectors
from embstore.hashing._format import write_arrays
from embstore.hashing._mix import mix64_py, seed_key
from embstore.hashing._table import build_table, lookup_kernel


def fitted() -> LearnedHash:
    rng = np.random.default_rng(0)
    return LearnedHash.fit(rng.zipf(1.3, size=5000).astype(np.int64), 64, seed=3)


def test_a_row_in_the_reserved_region_is_refused(tmp_path) -> None:
    h = fitted()
    rows = np.array(h._trows)
    rows[np.flatnonzero(rows != -1)[0]] = h.reserved_start  # the first reserved row: not the table's to give
    write_arrays(tmp_path / "m", h.meta, {"keys": np.array(h._tkeys), "rows": rows})
    with pytest.raises(CorruptStoreError, match="rows outside"):
        LearnedHash.load(tmp_path / "m")


def test_an_id_table_without_an_empty_slot_is_refused(tmp_path) -> None:
    """Lookups end at an empty slot; a table of exactly ``known_ids`` entries has none."""
    h = fitted()
    full = np.array(h._trows) != -1
    write_arrays(tmp_path / "m", h.meta, {"keys": np.array(h._tkeys)[full], "rows": np.array(h._trows)[full]})
    with pytest.raises(CorruptStoreError, match="one length > known_ids"):
        LearnedHash.load(tmp_path / "m")


# -- session 13 mutation audit of hashing/ (mod, qr, learned, _mix, _table, _cluster, _embed, base, factory) --

def _homed_on_the_last_slots(cap: int, table_key: int, count: int) -> np.ndarray:
    """``count`` ids whose home slot in a table of ``cap`` slots is one of its last two: every probe chain
    after the first runs over the end of the table and wraps to slot 0."""
    cand = np.arange(-50_000, 50_000, dtype=np.int64)
    home = np.array([mix64_py(int(x), table_key) % cap for x in cand])
    return cand[home >= cap - 2][:count]


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_the_id_table_finds_every_id_when_probe_chains_wrap(n: int) -> None:
    """Mutants: ``_build`` or ``lookup_kernel`` wrapping a probe past the last slot to slot 1 instead of 0.
    Fitted tables are sparse enough that no existing test had a chain over the end; here every id homes
    on the last two slots of a table with one free slot, so all but one chain wraps. Each id must get
    its own row (a dict is the reference) and an unseen id its reserved row."""
    table_key = seed_key(11)
    cap = n + 1  # what build_table gives n ids at load factor 0.95
    keys = _homed_on_the_last_slots(cap, table_key, n)
    rows = np.arange(100, 100 + n, dtype=np.int64)
    tkeys, trows = build_table(keys, rows, 200, table_key, 0.95)
    assert tkeys.shape == (cap,)
    unseen = np.array([123_456_789, -987_654_321], np.int64)
    probe = np.concatenate([keys[::-1], unseen])
    out = np.empty(probe.shape[0], np.int64)
    lookup_kernel(probe, tkeys, trows, np.uint64(table_key), np.int64(150), np.int64(50), np.uint64(seed_key(2)), out)
    want = dict(zip(keys.tolist(), rows.tolist()))
    assert out[:n].tolist() == [want[k] for k in keys[::-1].tolist()]
    assert out[n:].tolist() == (150 + ModHash(50, 2)(unseen)).tolist()


@pytest.mark.parametrize("n,size", [(10, 3), (2500, None), (7, 7), (0, 4)])
def test_contexts_without_batches_are_windows_of_context_size(n: int, size: int | None) -> None:
    """Mutant: ``contexts`` ignoring ``context_size`` when no batches are given (always 1024-access
    windows). The existing contexts test always passes batches; ``fit(trace, context_size=...)`` without
    them must cut the trace into windows of that size (1024 when None)."""
    want = [i // (size or 1024) for i in range(n)]
    assert contexts(n, None, size).tolist() == want


def test_a_bisection_splits_along_the_top_principal_axis() -> None:
    """Mutant: ``_direction`` without the loop that mirrors the covariance's upper triangle into the lower
    one (numba's ``eigh`` reads the lower: the matrix is then diagonal, the direction a coordinate axis).
    Two groups 2 apart along (1, -1), each spread along (1, 1) so that the x (or y) coordinates of the
    groups overlap: the principal axis is (1, -1) / sqrt(2) (numpy's weighted covariance says so), and
    one cut along it, with no 2-means refinement, separates the groups exactly."""
    rng = np.random.default_rng(0)
    side = np.repeat([-1.0, 1.0], 200)
    spread = rng.uniform(-1.5, 1.5, side.shape[0])
    x = np.stack([side + spread, -side + spread], axis=1)
    w = np.ones(side.shape[0])
    wd = w + 1.0
    centred = x - (wd[:, None] * x).sum(0) / wd.sum()
    top = np.linalg.eigh((wd[:, None] * centred).T @ centred)[1][:, -1]
    assert abs(top @ np.array([1.0, -1.0])) / np.sqrt(2) > 0.99
    assert abs(abs(_direction(x, wd, np.arange(side.shape[0])) @ top) - 1.0) < 1e-9
    assert not ((x[:, 0] > 0) == (side > 0)).all()  # a cut along an axis would mix the groups
    labels = balanced_bisect(x, w, 2, 0)
    assert (labels == (side > 0)).all() or (labels == (side < 0)).all()


def test_ids_with_zero_counts_still_steer_and_fill_every_cluster_row() -> None:
    """Mutant: ``balanced_bisect`` weighting points by their counts alone, not counts + 1. Ids given with a
    count of 0 (``fit((ids, counts))`` accepts them) then have no mass: a node of only such ids has a
    0/0 mean, a NaN direction, and its rows get arbitrary cuts. Here the vectors say which of two groups
    each id is in, every count is 0 (so the cut halves the points: 20 clustered ids a group), and the two
    clustered rows must be exactly the two groups."""
    ids = np.arange(41, dtype=np.int64)  # id 0 takes the dedicated row
    group = ids % 2
    vectors = np.stack([group * 10.0, np.zeros(41)], axis=1) + np.random.default_rng(0).normal(0, 0.1, (41, 2))
    h = LearnedHash.fit((ids, np.zeros(41)), 4, vectors=vectors, dedicated_fraction=0.25, reserved_fraction=0.25)
    assert (h.dedicated, h.cluster_rows) == (1, 2)
    rows = h(ids)
    clustered = rows >= h.dedicated
    for g in (0, 1):
        assert len(set(rows[clustered & (group == g)].tolist())) == 1
    assert set(rows[clustered].tolist()) == {1, 2}


def test_cooccurrence_vectors_are_the_documented_diffusion_map() -> None:
    """Mutant: the co-occurrence matrix without its degree normalisation (every access weight 1, not
    1 / sqrt(deg(id) deg(context))). The planted-group tests still pass (groups stay apart); here the
    vectors must equal, column by column up to sign, ``D_id^-1/2 U[:, 1:] sigma[1:]**2`` of a dense SVD of
    ``M = D_id^-1/2 A D_ctx^-1/2``, A the id-by-context count matrix (the formula in _embed.py)."""
    rng = np.random.default_rng(4)
    n_ids, n_ctx = 12, 40
    inverse = rng.integers(0, n_ids, 600)
    inverse[:n_ids] = np.arange(n_ids)  # every id accessed
    ctx = rng.integers(0, n_ctx, 600)
    ctx[n_ids:n_ids + n_ctx] = np.arange(n_ctx)
    a = np.zeros((n_ids, n_ctx))
    np.add.at(a, (inverse, ctx), 1.0)
    d_id, d_ctx = a.sum(1), a.sum(0)
    u, sigma, _ = np.linalg.svd(a / np.sqrt(np.outer(d_id, d_ctx)))
    want = u[:, 1:3] / np.sqrt(d_id)[:, None] * sigma[1:3] ** 2
    assert sigma[1] > 1.05 * sigma[2] > 1.1 * sigma[3]  # distinct: the columns are defined up to sign
    got = cooccurrence_vectors(inverse.astype(np.int64), n_ids, ctx.astype(np.int64), 2, seed=0, iterations=30)
    for j in range(2):
        sign = np.sign(got[:, j] @ want[:, j])
        np.testing.assert_allclose(sign * got[:, j], want[:, j], atol=1e-6)
