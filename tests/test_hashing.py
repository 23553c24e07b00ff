"""embstore.hashing against pure-Python references (SPEC section 4).

The references here are written from the documented definitions, not imported
from the package, so a kernel bug cannot hide behind a shared helper.

"A learned hash beats mod hashing in log loss at equal memory" is proven in
tests/test_hash_eval.py (a DLRM trained each way); this file checks the
mechanism that gain rests on (same-group ids share rows, test_planted_groups_*).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from embstore.config import HashConfig
from embstore.errors import ConfigError, CorruptStoreError, InvalidInputError
from embstore.hashing import LearnedHash, Mapper, ModHash, QRHash, build_hash

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
MASK = 2**64 - 1
EDGE_IDS = [0, 1, -1, 2, -2, I64_MAX, I64_MIN, I64_MAX - 1, I64_MIN + 1, 2**62, -(2**62), 2**32, -(2**32) - 1]

int64s = st.one_of(st.integers(I64_MIN, I64_MAX), st.sampled_from(EDGE_IDS),
                   st.integers(I64_MAX - 1000, I64_MAX), st.integers(I64_MIN, I64_MIN + 1000))
id_lists = st.lists(int64s, min_size=0, max_size=200)


# -- references ----------------------------------------------------------------------

def ref_fmix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def ref_mod(x: int, buckets: int, seed: int) -> int:
    """Documented ModHash: fmix((x mod 2**64) ^ key) % buckets, key = fmix(seed + golden ratio)."""
    key = ref_fmix((seed + 0x9E3779B97F4A7C15) % 2**64)
    return ref_fmix((x % 2**64) ^ key) % buckets


def ref_qr(x: int, buckets: int, m: int) -> tuple[int, int]:
    nq = buckets - m
    return (x // m) % nq, nq + x % m  # Python ints: floor division and modulo, exact


def arr(xs: list[int]) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


# -- ModHash -------------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(ids=id_lists, buckets=st.one_of(st.integers(1, 1000), st.integers(1, I64_MAX)), seed=st.integers(0, I64_MAX))
def test_mod_matches_python_reference_exactly(ids, buckets, seed):
    h = ModHash(buckets, seed)
    out = h(arr(ids))
    assert out.dtype == np.int64 and out.shape == (len(ids),)
    assert out.tolist() == [ref_mod(x, buckets, seed) for x in ids]
    assert ((out >= 0) & (out < buckets)).all()


@settings(max_examples=50, deadline=None)
@given(ids=id_lists, buckets=st.integers(1, 10**12), seed=st.integers(0, 2**40))
def test_mod_vectorised_equals_one_at_a_time_and_repeatable(ids, buckets, seed):
    h = ModHash(buckets, seed)
    out = h(arr(ids))
    assert out.tolist() == [int(h(arr([x]))[0]) for x in ids]
    assert out.tolist() == ModHash(buckets, seed)(arr(ids)).tolist()
    assert out.tolist() == [h.row_of(x) for x in ids]


def test_mod_spreads_sequential_and_strided_ids_evenly():
    # plain id % 100 would put every multiple of 100 in bucket 0
    for ids in (np.arange(100_000, dtype=np.int64), np.arange(100_000, dtype=np.int64) * 100 - 5_000_000):
        counts = np.bincount(ModHash(100, 7)(ids), minlength=100)
        assert counts.min() > 800 and counts.max() < 1200  # 1000 expected, sd ~31


def test_mod_seeds_give_different_functions():
    ids = np.arange(10_000, dtype=np.int64)
    a, b = ModHash(1 << 20, 0)(ids), ModHash(1 << 20, 1)(ids)
    assert (a != b).mean() > 0.99


def test_mod_invalid_arguments_name_them():
    for kwargs, key in (({"buckets": 0}, "buckets"), ({"buckets": 2**63}, "buckets"), ({"buckets": 2.0}, "buckets"),
                        ({"buckets": True}, "buckets"), ({"buckets": 5, "seed": -1}, "seed"),
                        ({"buckets": 5, "seed": "x"}, "seed")):
        with pytest.raises(ConfigError) as e:
            ModHash(**kwargs)
        assert e.value.key == key


@pytest.mark.parametrize("make", [lambda: ModHash(10), lambda: QRHash(10, 3),
                                  lambda: LearnedHash.fit(np.arange(30, dtype=np.int64) % 7, 10)])
def test_bad_ids_raise_invalid_input(make):
    mapper = make()
    for bad in (np.array([1.0]), np.array([[1, 2]], np.int64), [1, 2], torch.tensor([1, 2]),
                np.array([1], np.int32)):
        with pytest.raises(InvalidInputError):
            mapper(bad)
    assert mapper(np.array([], np.int32)).shape[0] == 0
    readonly = np.arange(-5, 5, dtype=np.int64)
    readonly.flags.writeable = False  # e.g. a memmap or a torch tensor's numpy view
    assert np.array_equal(mapper(readonly), mapper(readonly.copy()))
    strided = np.arange(20, dtype=np.int64)[::2]
    assert np.array_equal(mapper(strided), mapper(strided.copy()))


_DETERMINISM_SCRIPT = """
import json, sys
import numpy as np
from embstore.hashing import ModHash, QRHash, LearnedHash
ids = np.array(json.loads(sys.argv[1]), dtype=np.int64)
out = {"mod": ModHash(1000003, 42)(ids).tolist(), "qr": QRHash(1000, 7)(ids).tolist(),
       "learned": LearnedHash.load(sys.argv[2])(ids).tolist()}
print(json.dumps(out))
"""


def test_deterministic_across_processes(tmp_path):
    rng = np.random.default_rng(3)
    trace = rng.zipf(1.3, 5000).astype(np.int64)
    learned = LearnedHash.fit(trace, 300, seed=5)
    learned.save(tmp_path / "m.ehash")
    ids = EDGE_IDS + rng.integers(I64_MIN, I64_MAX, 200, endpoint=True).tolist() + trace[:200].tolist()
    res = subprocess.run([sys.executable, "-c", _DETERMINISM_SCRIPT, json.dumps(ids), str(tmp_path / "m.ehash")],
                         capture_output=True, text=True, check=True, timeout=300)
    other = json.loads(res.stdout)
    a = arr(ids)
    assert other["mod"] == ModHash(1000003, 42)(a).tolist()
    assert other["qr"] == QRHash(1000, 7)(a).tolist()
    assert other["learned"] == learned(a).tolist()


# -- QRHash --------------------------------------------------------------------------

qr_shapes = st.integers(1, 50).flatmap(lambda m: st.tuples(st.just(m), st.integers(m + 1, m + 60)))


@settings(max_examples=150, deadline=None)
@given(ids=id_lists, shape=st.one_of(qr_shapes, st.tuples(st.integers(1, 2**40), st.just(2**62))))
def test_qr_matches_reference_and_range(ids, shape):
    m, buckets = shape
    h = QRHash(buckets, m)
    out = h(arr(ids))
    assert out.dtype == np.int64 and out.shape == (len(ids), 2)
    assert [tuple(r) for r in out.tolist()] == [ref_qr(x, buckets, m) for x in ids]
    assert ((out >= 0) & (out < buckets)).all()
    assert (out[:, 0] < buckets - m).all() and (out[:, 1] >= buckets - m).all()
    assert out.tolist() == [h(arr([x]))[0].tolist() for x in ids]


@settings(max_examples=60, deadline=None)
@given(shape=qr_shapes, block=st.integers(-(2**40), 2**40))
def test_qr_pairs_unique_within_id_space(shape, block):
    """Any m * (buckets - m) consecutive ids (negative ones too) get distinct (q, r) pairs."""
    m, buckets = shape
    space = m * (buckets - m)
    ids = np.arange(space, dtype=np.int64) + block * space
    out = QRHash(buckets, m)(ids)
    assert len({(int(q), int(r)) for q, r in out}) == space
    # and the mapping repeats with period `space`
    assert np.array_equal(out, QRHash(buckets, m)(ids + space))


def test_qr_combine_numpy_and_torch_with_gradients():
    rng = np.random.default_rng(0)
    parts = rng.standard_normal((5, 2, 4)).astype(np.float32)
    for kind, expect in (("mult", parts[:, 0] * parts[:, 1]), ("add", parts[:, 0] + parts[:, 1]),
                         ("concat", np.concatenate([parts[:, 0], parts[:, 1]], axis=1))):
        h = QRHash(100, 4, kind)
        assert np.allclose(h.combine(parts), expect)
        t = torch.tensor(parts, requires_grad=True)
        out = h.combine(t)
        assert np.allclose(out.detach().numpy(), expect)
        out.sum().backward()
        assert t.grad is not None and t.grad.shape == t.shape
        if kind == "mult":
            assert torch.allclose(t.grad[:, 0], t.detach()[:, 1])
    assert QRHash(100, 4, "concat").physical_dim(8) == 4 and QRHash(100, 4, "mult").physical_dim(7) == 7
    with pytest.raises(ValueError):
        QRHash(100, 4, "concat").physical_dim(7)


def test_single_row_mappers_combine_is_identity_reshape():
    parts = np.arange(12, dtype=np.float32).reshape(3, 1, 4)
    for h in (ModHash(10), LearnedHash.fit(arr([1, 2, 3]), 10)):
        assert h.rows_per_id == 1 and h.physical_dim(4) == 4
        assert np.array_equal(h.combine(parts), parts[:, 0])
        t = torch.tensor(parts, requires_grad=True)
        h.combine(t).sum().backward()
        assert torch.equal(t.grad, torch.ones_like(t))


def test_qr_invalid_arguments_name_them():
    for args, key in (((4, 4), "buckets"), ((10, 0), "collisions"), ((10, 2, "max"), "combine"),
                      ((10, 2.5), "collisions")):
        with pytest.raises(ConfigError) as e:
            QRHash(*args)
        assert e.value.key == key


# -- LearnedHash ---------------------------------------------------------------------

def zipf_counts(rng: np.random.Generator, n: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.choice(2**62, n, replace=False).astype(np.int64) * rng.choice([-1, 1], n)
    counts = np.floor(1e5 / np.arange(1, n + 1) ** alpha).astype(np.int64)
    return ids, rng.permutation(counts)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 3000), buckets=st.integers(2, 600), alpha=st.floats(0.0, 1.5),
       dedicated=st.floats(0.0, 1.0), reserved=st.floats(0.0, 0.5), seed=st.integers(0, 2**31),
       use_vectors=st.booleans())
def test_learned_layout_dedicated_clusters_reserved(n, buckets, alpha, dedicated, reserved, seed, use_vectors):
    rng = np.random.default_rng(seed)
    ids, counts = zipf_counts(rng, n, alpha)
    vectors = rng.standard_normal((n, 3)) if use_vectors else None
    h = LearnedHash.fit((ids, counts), buckets, vectors=vectors, dedicated_fraction=dedicated,
                        reserved_fraction=reserved, seed=seed)
    ded, clu, rs = h.dedicated, h.cluster_rows, h.reserved_start
    assert h.num_rows == buckets and rs == ded + clu and h.reserved_rows >= max(1, math.ceil(reserved * buckets))
    rows = h(ids)
    assert ((rows >= 0) & (rows < rs)).all()
    # the `ded` most accessed ids (ties by id) own rows 0.. ded-1, hottest first, and nobody else is there
    rank = np.lexsort((ids, -counts))
    assert np.array_equal(rows[rank[:ded]], np.arange(ded))
    assert (rows[rank[ded:]] >= ded).all()
    if n <= buckets - max(1, math.ceil(reserved * buckets)):
        assert ded == n and clu == 0  # everything fits: all dedicated
    else:
        assert ded == min(int(dedicated * buckets), buckets - max(1, math.ceil(reserved * buckets)) - 1)
        tail_rows = rows[rank[ded:]]
        assert set(np.unique(tail_rows)) == set(range(ded, rs))  # every cluster row used
        # balance: each clustered row's access mass <= mean + ceil(log2 C) * max single mass (see _cluster.py)
        mass = np.bincount(tail_rows - ded, weights=counts[rank[ded:]], minlength=clu)
        w_max = counts[rank[ded:]].max()
        assert mass.max() <= counts[rank[ded:]].sum() / clu + math.ceil(math.log2(clu) if clu > 1 else 0) * w_max + 1e-6
    # unseen ids: exactly ModHash(reserved_rows, seed) shifted into the reserved region
    unseen = rng.integers(I64_MIN, I64_MAX, 300, endpoint=True)
    unseen = unseen[~np.isin(unseen, ids)]
    got = h(unseen)
    assert np.array_equal(got, rs + ModHash(h.reserved_rows, seed)(unseen))
    both = np.concatenate([ids[:50], unseen[:50]])
    assert h(both).tolist() == [int(h(arr([x]))[0]) for x in both.tolist()]
    known_ids, known_rows = h.known_ids()
    order = np.argsort(ids)
    assert np.array_equal(known_ids, ids[order]) and np.array_equal(known_rows, rows[order])


def test_learned_balances_a_heavy_tail_better_than_plain_hashing():
    rng = np.random.default_rng(0)
    ids, counts = zipf_counts(rng, 20_000, 1.1)
    h = LearnedHash.fit((ids, counts), 2_000, dedicated_fraction=0.2)
    tail = h(ids) >= h.dedicated
    mass = np.bincount(h(ids)[tail] - h.dedicated, weights=counts[tail])
    avg = counts[tail].sum() / h.cluster_rows
    assert mass.max() <= 1.25 * avg + counts[tail].max()
    mod_mass = np.bincount(ModHash(h.cluster_rows)(ids[tail]), weights=counts[tail])
    assert mass.max() < mod_mass.max()


def test_learned_fit_is_deterministic_and_save_load_round_trips(tmp_path):
    rng = np.random.default_rng(1)
    trace = (rng.zipf(1.2, 20_000) * 7919 - 10**6).astype(np.int64)
    offsets = np.arange(0, 20_001, 500, dtype=np.int64)
    a = LearnedHash.fit(trace, 500, batch_offsets=offsets, seed=3)
    b = LearnedHash.fit(trace, 500, batch_offsets=offsets, seed=3)
    probe = np.concatenate([trace, rng.integers(I64_MIN, I64_MAX, 2000, endpoint=True), arr(EDGE_IDS)])
    assert np.array_equal(a(probe), b(probe))
    a.save(tmp_path / "m.ehash")
    c = LearnedHash.load(tmp_path / "m.ehash")
    assert np.array_equal(a(probe), c(probe))
    assert c.mapping_bytes == a.mapping_bytes > 0
    assert all(np.array_equal(x, y) for x, y in zip(a.known_ids(), c.known_ids()))
    assert (c.num_rows, c.dedicated, c.cluster_rows, c.reserved_rows) == (a.num_rows, a.dedicated, a.cluster_rows,
                                                                           a.reserved_rows)
    assert c.meta == json.loads(json.dumps(a.meta))
    assert not c._tkeys.flags.writeable  # mapped read-only, not copied
    # overwrite in place (atomic replace) and reload
    LearnedHash.fit(trace, 400).save(tmp_path / "m.ehash")
    assert LearnedHash.load(tmp_path / "m.ehash").num_rows == 400
    assert [p.name for p in tmp_path.iterdir()] == ["m.ehash"]


def test_learned_small_inputs():
    h = LearnedHash.fit(arr([5, 5, 9]), 2)  # 2 seen ids, 1 row left after the reserved one: they share it
    assert (h.dedicated, h.cluster_rows, h.reserved_rows) == (0, 1, 1)
    assert h(arr([5, 9, 123])).tolist() == [0, 0, 1]
    h = LearnedHash.fit(arr([5, 5, 9, 7]), 4)  # 3 rows for 3 ids: all dedicated, hottest first, ties by id
    assert (h.dedicated, h.cluster_rows, h.reserved_rows) == (3, 0, 1)
    assert h(arr([5, 7, 9, 123])).tolist() == [0, 1, 2, 3]
    empty = LearnedHash.fit(arr([]), 10)  # no history: everything hashed over all rows
    assert empty.reserved_rows == 10 and np.array_equal(empty(arr(EDGE_IDS)), ModHash(10)(arr(EDGE_IDS)))
    counts_only = LearnedHash.fit((arr([3, 1, 2]), np.array([1.0, 5.0, 0.0])), 3, reserved_fraction=0.1)
    assert counts_only(arr([1, 3, 2, 99])).tolist() == [0, 1, 1, 2]


def test_learned_invalid_arguments_name_them():
    ids = arr([1, 2, 3])
    cases = [
        (lambda: LearnedHash.fit(ids, 1), "buckets"),
        (lambda: LearnedHash.fit(ids, 10, dedicated_fraction=1.5), "dedicated_fraction"),
        (lambda: LearnedHash.fit(ids, 10, reserved_fraction=-0.1), "reserved_fraction"),
        (lambda: LearnedHash.fit(ids, 2, reserved_fraction=0.99), "reserved_fraction"),
        (lambda: LearnedHash.fit(ids, 10, dim=0), "dim"),
        (lambda: LearnedHash.fit(np.array([1.5]), 10), "trace_or_counts"),
        (lambda: LearnedHash.fit([1, 2], 10), "trace_or_counts"),
        (lambda: LearnedHash.fit((ids, np.array([1, 2])), 10), "counts"),
        (lambda: LearnedHash.fit((ids, np.array([1, -2, 1])), 10), "counts"),
        (lambda: LearnedHash.fit((arr([1, 1, 2]), np.array([1, 2, 1])), 10), "ids"),
        (lambda: LearnedHash.fit(ids, 10, vectors=np.ones((2, 3))), "vectors"),
        (lambda: LearnedHash.fit(ids, 10, vectors=np.full((3, 2), np.nan)), "vectors"),
        (lambda: LearnedHash.fit(ids, 10, batch_offsets=arr([0, 2])), "batch_offsets"),
        (lambda: LearnedHash.fit(np.array([2**63], np.uint64), 10), "trace_or_counts"),
    ]
    for call, key in cases:
        with pytest.raises(ConfigError) as e:
            call()
        assert e.value.key == key, (key, e.value)


def test_learned_load_errors_name_the_path(tmp_path):
    with pytest.raises(ConfigError, match="nope.ehash"):
        LearnedHash.load(tmp_path / "nope.ehash")
    path = tmp_path / "m.ehash"
    LearnedHash.fit(np.arange(1000, dtype=np.int64) % 300, 100).save(path)
    good = path.read_bytes()
    corruptions = {
        "magic": b"XXXXXXXX" + good[8:],
        "truncated": good[: len(good) // 2],
        "flipped": good[:-40] + bytes([good[-40] ^ 0xFF]) + good[-39:],
        "header": good[:20] + b"}" + good[21:],
        "empty": b"",
    }
    for name, data in corruptions.items():
        path.write_bytes(data)
        with pytest.raises(CorruptStoreError, match=str(path)):
            LearnedHash.load(path)


def _rewrite_header(path, edit) -> None:
    """Apply ``edit`` to the JSON header of a saved mapping and write it back, keeping the data where it is
    (the header is padded to its old length, so the arrays' offsets stay valid)."""
    import struct

    raw = path.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[8:16])
    header = json.loads(raw[16:16 + hlen])
    header["meta"].pop("fit")  # room for longer values
    edit(header)
    text = json.dumps(header, sort_keys=True).encode()
    assert len(text) <= hlen
    path.write_bytes(raw[:8] + struct.pack("<Q", hlen) + text.ljust(hlen) + raw[16 + hlen:])


@pytest.mark.parametrize("field, value", [
    ("num_rows", 99.5), ("num_rows", 1e300), ("num_rows", True), ("seed", 2.5), ("known_ids", "3"),
    ("version", True), ("version", 1.0),
])
def test_learned_load_refuses_non_integer_header_fields(tmp_path, field, value):
    """A float in the header used to be truncated (99.5 rows -> 99, a different table) or to escape as a raw
    OverflowError (1e300); it is corruption, reported as such."""
    path = tmp_path / "m.ehash"
    LearnedHash.fit(np.arange(1000, dtype=np.int64) % 300, 100).save(path)
    _rewrite_header(path, lambda h: h["meta"].__setitem__(field, value))
    with pytest.raises(CorruptStoreError, match=str(path)):
        LearnedHash.load(path)


@pytest.mark.parametrize("edit", [
    {"shape": [2**62, 2**62]}, {"shape": [2**70]}, {"shape": [1.5]}, {"shape": 7}, {"offset": 2**70},
    {"offset": 0.5}, {"dtype": "O"}, {"dtype": "V8"}, {"dtype": [["a", "<i8"]]}, {"crc32": 1.5},
])
def test_learned_load_refuses_impossible_array_descriptions(tmp_path, edit):
    path = tmp_path / "m.ehash"
    LearnedHash.fit(np.arange(1000, dtype=np.int64) % 300, 100).save(path)
    _rewrite_header(path, lambda h: h["arrays"]["keys"].update(edit))
    with pytest.raises(CorruptStoreError, match=str(path)):
        LearnedHash.load(path)


@pytest.mark.parametrize("field", ["table_key", "seed"])
def test_learned_load_detects_a_damaged_header_that_still_parses(tmp_path, field):
    """One wrong digit in the header (the unseen-id seed, the slot hash key) used to load fine and map ids
    elsewhere without a word: the header has its own CRC now."""
    path = tmp_path / "m.ehash"
    fitted = LearnedHash.fit(np.arange(1000, dtype=np.int64) % 300, 100, seed=7)
    fitted.save(path)
    raw = path.read_bytes()
    text = f'"{field}": {fitted.meta[field]}'.encode()
    assert raw.count(text) == 1
    damaged = f'"{field}": {fitted.meta[field] - 1}'.encode().ljust(len(text))
    path.write_bytes(raw.replace(text, damaged))
    with pytest.raises(CorruptStoreError, match="header"):
        LearnedHash.load(path)


# -- the point of learning: similar ids collide --------------------------------------

def planted_trace(seed: int, groups: int = 8, per_group: int = 125, batches: int = 300, batch: int = 64,
                  noise: float = 0.1):
    """Ids in `groups` groups; each batch draws (Zipf within the group) from one group, plus `noise` random ids."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(2**62, groups * per_group, replace=False).astype(np.int64) - 2**61
    group = np.repeat(np.arange(groups), per_group)
    pop = 1 / np.arange(1, per_group + 1) ** 0.8
    pop /= pop.sum()
    parts = []
    for _ in range(batches):
        acc = ids[rng.integers(groups) * per_group + rng.choice(per_group, batch, p=pop)]
        mask = rng.random(batch) < noise
        acc[mask] = ids[rng.integers(0, ids.size, int(mask.sum()))]
        parts.append(acc)
    return np.concatenate(parts), np.arange(0, batches * batch + 1, batch, dtype=np.int64), ids, group


def same_group_collision_share(rows: np.ndarray, group: np.ndarray, counts: np.ndarray) -> float:
    """Of all access-weighted pairs of distinct ids sharing a row, the share whose ids are in one group."""
    same = total = 0.0
    for r in np.unique(rows):
        sel = rows == r
        c, g = counts[sel].astype(float), group[sel]
        total += c.sum() ** 2 - (c**2).sum()
        same += sum(c[g == k].sum() ** 2 - (c[g == k] ** 2).sum() for k in np.unique(g))
    return same / total


@pytest.mark.parametrize("seed,dedicated", [(0, 0.5), (1, 0.0), (2, 0.3)])
def test_planted_groups_learned_collides_within_groups_far_more_than_mod(seed, dedicated):
    trace, offsets, ids, group = planted_trace(seed)
    uniq, counts = np.unique(trace, return_counts=True)
    g = group[np.argsort(ids)][np.searchsorted(np.sort(ids), uniq)]
    buckets = ids.size // 10  # 10% of the rows
    learned = LearnedHash.fit(trace, buckets, batch_offsets=offsets, dedicated_fraction=dedicated, seed=seed)
    ours = same_group_collision_share(learned(uniq), g, counts)
    mod = same_group_collision_share(ModHash(buckets, seed)(uniq), g, counts)
    assert mod < 0.2  # chance is 1/8
    assert ours > 0.8 and ours > 4 * mod, (ours, mod)


def test_planted_groups_with_given_vectors():
    trace, _, ids, group = planted_trace(4)
    uniq, counts = np.unique(trace, return_counts=True)
    g = group[np.argsort(ids)][np.searchsorted(np.sort(ids), uniq)]
    vectors = np.eye(8)[g] + 0.05 * np.random.default_rng(0).standard_normal((uniq.size, 8))
    learned = LearnedHash.fit((uniq, counts), ids.size // 10, vectors=vectors, dedicated_fraction=0.0)
    assert same_group_collision_share(learned(uniq), g, counts) > 0.9
    # vectors[i] belongs to ids[i] whatever the order the pair comes in
    perm = np.random.default_rng(1).permutation(uniq.size)
    shuffled = LearnedHash.fit((uniq[perm], counts[perm]), ids.size // 10, vectors=vectors[perm],
                               dedicated_fraction=0.0)
    assert np.array_equal(shuffled(uniq), learned(uniq))


# -- build_hash ----------------------------------------------------------------------

def test_build_hash_kinds(tmp_path):
    assert build_hash(HashConfig(), 100) is None
    mod = build_hash(HashConfig(kind="mod", seed=9), 100)
    assert isinstance(mod, ModHash) and (mod.num_rows, mod.seed) == (100, 9)
    qr = build_hash(HashConfig(kind="qr", collisions=4, combine="concat"), 100)
    assert isinstance(qr, QRHash) and (qr.num_rows, qr.collisions, qr.combine_kind) == (100, 4, "concat")
    assert isinstance(qr, Mapper) and qr.rows_per_id == 2 and qr.mapping_bytes == 0
    with pytest.raises(ConfigError) as e:
        build_hash(HashConfig(kind="qr", collisions=100), 100)
    assert e.value.key == "hash.collisions"
    fitted = LearnedHash.fit(np.arange(500, dtype=np.int64) % 77, 50)
    (tmp_path / "maps").mkdir()
    fitted.save(tmp_path / "maps" / "c1.ehash")
    learned = build_hash(HashConfig(kind="learned", mapping="maps/c1.ehash"), 50, base_dir=tmp_path)
    assert isinstance(learned, LearnedHash) and learned.mapping_bytes == fitted.mapping_bytes
    absolute = build_hash(HashConfig(kind="learned", mapping=str(tmp_path / "maps" / "c1.ehash")), 50)
    assert np.array_equal(absolute(np.arange(100, dtype=np.int64)), fitted(np.arange(100, dtype=np.int64)))
    with pytest.raises(ConfigError) as e:
        build_hash(HashConfig(kind="learned", mapping="maps/c1.ehash"), 60, base_dir=tmp_path)
    assert e.value.key == "hash.mapping" and "50" in str(e.value)
    with pytest.raises(ConfigError) as e:
        build_hash(HashConfig(kind="learned", mapping="maps/missing.ehash"), 50, base_dir=tmp_path)
    assert e.value.key == "hash.mapping" and "missing.ehash" in str(e.value)
    (tmp_path / "maps" / "bad.ehash").write_bytes(b"not a mapping")
    with pytest.raises(CorruptStoreError, match="bad.ehash"):
        build_hash(HashConfig(kind="learned", mapping="maps/bad.ehash"), 50, base_dir=tmp_path)


# -- CLI -----------------------------------------------------------------------------

def test_cli_fit_from_npy(tmp_path, capsys):
    from embstore.commands.hash_cmds import main

    trace = (np.random.default_rng(0).zipf(1.3, 5000) - 50).astype(np.int64)
    np.save(tmp_path / "ids.npy", trace)
    assert main(["hash", "fit", str(tmp_path / "ids.npy"), "--buckets", "200", "--out", str(tmp_path / "m.ehash"),
                 "--seed", "4"]) == 0
    out, err = capsys.readouterr()
    assert "wrote" in out and "[hash fit" in err
    loaded = LearnedHash.load(tmp_path / "m.ehash")
    direct = LearnedHash.fit(trace, 200, seed=4)
    probe = np.concatenate([trace, arr(EDGE_IDS)])
    assert np.array_equal(loaded(probe), direct(probe))


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    from embstore.commands.hash_cmds import main

    np.save(tmp_path / "ids.npy", np.arange(10, dtype=np.int64))
    np.save(tmp_path / "floats.npy", np.ones(3))
    cases = [
        (["hash", "fit", str(tmp_path / "missing.npy"), "--buckets", "10", "--out", str(tmp_path / "m")],
         "does not exist"),
        (["hash", "fit", str(tmp_path / "floats.npy"), "--buckets", "10", "--out", str(tmp_path / "m")], "integer"),
        (["hash", "fit", str(tmp_path / "ids.npy"), "--buckets", "1", "--out", str(tmp_path / "m")], "buckets"),
        (["hash", "fit", str(tmp_path / "ids.npy"), "--buckets", "10", "--out", str(tmp_path / "no" / "m")], "--out"),
        (["hash", "fit", str(tmp_path / "ids.npy"), "--buckets", "10", "--out", str(tmp_path / "m"), "--table", "x"],
         "--table"),
    ]
    for argv, needle in cases:
        assert main(argv + ["--quiet"]) == 2
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and err.startswith("embstore hash fit: error:") and needle in err, err
    with pytest.raises(SystemExit) as e:
        main(["hash", "fit", "--help"])
    assert e.value.code == 0
    assert "Learning to Collide" in capsys.readouterr().out


def test_cli_refuses_uint64_ids_beyond_int64_and_a_directory_as_out(tmp_path, capsys):
    """2**64 - 1 in a uint64 .npy used to wrap to id -1 and be fitted as such; --out naming a directory
    failed only after the fit, naming a temp file."""
    from embstore.commands.hash_cmds import main

    np.save(tmp_path / "big.npy", np.array([2**64 - 1, 5], np.uint64))
    assert main(["hash", "fit", str(tmp_path / "big.npy"), "--buckets", "10", "--out", str(tmp_path / "m"),
                 "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "int64" in err and not (tmp_path / "m").exists()
    np.save(tmp_path / "ok.npy", np.array([2**63 - 1, 5], np.uint64))  # in range: fine
    assert main(["hash", "fit", str(tmp_path / "ok.npy"), "--buckets", "10", "--out", str(tmp_path / "m"),
                 "--quiet"]) == 0
    assert LearnedHash.load(tmp_path / "m")(arr([5, I64_MAX])).tolist() == [0, 1]  # one access each: by id
    capsys.readouterr()
    (tmp_path / "d").mkdir()
    for out in (tmp_path / "d", tmp_path):
        assert main(["hash", "fit", str(tmp_path / "ok.npy"), "--buckets", "10", "--out", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--out" in err and "directory" in err and ".tmp" not in err, err


def test_cli_fits_one_table_of_a_trace(tmp_path, monkeypatch, capsys):
    """Through a real npz trace (embstore.traces) and --table by name or index."""
    from embstore.commands import hash_cmds

    trace, offsets, _, _ = planted_trace(5, batches=40)
    other = np.full(trace.size, 12345, np.int64)
    # interleave table 0 (constant id) and table 1 (the planted trace) within each batch
    ids = np.stack([other, trace], axis=1).reshape(-1)
    table = np.tile(np.array([0, 1], np.int32), trace.size)
    from embstore.traces import Trace, save

    fake = Trace(ids, table, offsets * 2, ("a", "b"))
    sel_ids, sel_off, label = hash_cmds.select_table(fake, "b")
    assert label == "b" and np.array_equal(sel_ids, trace) and np.array_equal(sel_off, offsets)
    assert hash_cmds.select_table(fake, "1")[2] == "b" and hash_cmds.select_table(fake, None)[2] == "a"
    save(fake, tmp_path / "t.npz")
    for table_arg in ("b", "1"):
        assert hash_cmds.main(["hash", "fit", str(tmp_path / "t.npz"), "--buckets", "100", "--out",
                               str(tmp_path / "m.ehash"), "--table", table_arg, "--quiet"]) == 0
        got = LearnedHash.load(tmp_path / "m.ehash")
        want = LearnedHash.fit(trace, 100, batch_offsets=offsets)
        assert np.array_equal(got(trace), want(trace))
    assert hash_cmds.main(["hash", "fit", str(tmp_path / "t.npz"), "--buckets", "100", "--out",
                           str(tmp_path / "m.ehash"), "--table", "7", "--quiet"]) == 2
    assert "no accesses" in capsys.readouterr().err


def test_cli_through_embstore_main_with_a_real_trace_file(tmp_path, capsys):
    from embstore import traces
    from embstore.cli import main

    trace, offsets, _, _ = planted_trace(6, batches=30)
    ids = np.concatenate([trace, np.arange(100, dtype=np.int64)])
    table = np.concatenate([np.ones(trace.size, np.int32), np.zeros(100, np.int32)])
    traces.save(traces.Trace(ids, table, np.append(offsets, ids.size), ("small", "big")), tmp_path / "t.npz")
    assert main(["hash", "fit", str(tmp_path / "t.npz"), "--table", "big", "--buckets", "90",
                 "--out", str(tmp_path / "m.ehash")]) == 0
    assert "wrote" in capsys.readouterr().out
    want = LearnedHash.fit(trace, 90, batch_offsets=np.append(offsets, trace.size))
    assert np.array_equal(LearnedHash.load(tmp_path / "m.ehash")(trace), want(trace))
    assert main(["hash", "fit", str(tmp_path / "t.npz"), "--table", "nope", "--buckets", "90",
                 "--out", str(tmp_path / "m.ehash")]) == 2
    assert "no table 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["hash", "--help"])
    assert "fit" in capsys.readouterr().out


def test_orthonormal_falls_back_on_rank_deficient_input():
    from embstore.hashing._embed import orthonormal

    rng = np.random.default_rng(0)
    for y in (rng.standard_normal((200, 6)), np.repeat(rng.standard_normal((200, 1)), 6, axis=1)):
        q = orthonormal(y)
        assert q.shape == y.shape and np.allclose(q.T @ q, np.eye(6), atol=1e-8)
        assert np.allclose(q @ (q.T @ y), y)  # spans y's columns
