"""Audit of id hashing before ids reach a table (SPEC section 4, README "Hashing").

Short references written from the documented definitions, not from the package:

* mod: ``splitmix64_fmix(uint64(id) ^ key(seed)) % num_embeddings`` for every int64, negatives and
  int64 min/max included (README: "splitmix64 mix, then modulo num_embeddings");
* qr: quotient row ``(id // m) mod (B - m)``, remainder row ``B - m + id mod m`` (floor semantics), one
  embedding ``combine``d from the two (mult | add | concat);
* learned: the documented layout (dedicated rows for the hottest ids, hottest first and ties by id;
  clustered rows for the other seen ids; unseen ids by ``ModHash(reserved_rows, seed)`` after the
  reserved start), kept exactly across save/load and in another process.

Through stores (several tier stacks, flush + reopen), lookups and updates of hashed tables must agree
with a dict keyed by the hashed row (ids that collide share the row: the last write to any of them is
what every one of them reads), and pooled lookups with the sum/mean of those rows. Boundaries: buckets
of 1, buckets far beyond the id space, mapping files truncated or bit-flipped anywhere, a mapping of
another bucket count (at create and at reopen), ``hash fit --buckets 0`` / more buckets than ids, pooled
lookups of only empty bags on QR tables (a raw reshape error for 'concat', fixed), and
fit inputs the validation accepted but the fit could not handle (raw exceptions, now ConfigError).
What tests/test_hashing.py already proves on the bare mappers (ModHash/QRHash against references,
the header edits, the CLI's other errors) is not repeated.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.errors import ConfigError, CorruptStoreError, InvalidInputError
from embstore.hashing import LearnedHash, QRHash
from embstore.rows import RowFormat

I64_MIN, I64_MAX = -(2**63), 2**63 - 1
EDGES = [0, 1, -1, 2, -2, I64_MAX, I64_MIN, I64_MAX - 1, I64_MIN + 1, 2**62, -(2**62), 2**32, -(2**32) - 1]
int64s = st.one_of(st.sampled_from(EDGES), st.integers(-50, 50), st.integers(I64_MIN, I64_MAX))
DIM = 4


# -- references -------------------------------------------------------------------------

def _fmix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    return z ^ (z >> 31)


def ref_mod(x: int, buckets: int, seed: int) -> int:
    return _fmix((x % 2**64) ^ _fmix((seed + 0x9E3779B97F4A7C15) % 2**64)) % buckets


def ref_qr(x: int, buckets: int, m: int) -> tuple[int, int]:
    return (x // m) % (buckets - m), buckets - m + x % m


def ref_layout(n: int, buckets: int, dedicated: float, reserved: float) -> tuple[int, int]:
    """(dedicated rows, clustered rows) as learned.py's docstring and the README describe them."""
    avail = buckets - max(1, math.ceil(reserved * buckets))
    if n <= avail:
        return n, 0
    ded = min(int(dedicated * buckets), avail - 1)
    return ded, avail - ded


def arr(xs) -> np.ndarray:
    return np.array(list(xs), dtype=np.int64)


# -- stores -------------------------------------------------------------------------------

def _tiers(stack: str, rows: int, pdim: int) -> tuple[TierConfig, ...]:
    rb = RowFormat(pdim, "float32").row_bytes
    return {
        "dram-whole": (TierConfig("dram", rows * rb, "lru"), TierConfig("mmap")),
        "dram-part": (TierConfig("dram", 2 * rb, "lru"), TierConfig("ssd")),
        "device-whole": (TierConfig("device", rows * rb, "lru", device="cpu"), TierConfig("mmap")),
        "mmap": (TierConfig("mmap"),),
        "rocksdb": (TierConfig("dram", 2 * rb, "lfu"), TierConfig("rocksdb")),
    }[stack]


def _config(stack: str, rows: int, hash_cfg: dict, dim: int = DIM) -> StoreConfig:
    pdim = dim // 2 if hash_cfg.get("combine") == "concat" else dim
    whole = min(rows, 64)  # a "whole" tier of a huge sparse table is a partial one
    return StoreConfig((TableConfig("t", rows, dim, init={"kind": "uniform", "scale": 0.5, "seed": 7},
                                    hash=hash_cfg, tiers=_tiers(stack, whole, pdim)),))


STACKS = ("dram-whole", "dram-part", "device-whole", "mmap", "rocksdb")

ops = st.lists(st.one_of(
    st.tuples(st.just("update"), st.lists(int64s, min_size=1, max_size=8)),
    st.tuples(st.just("lookup"), st.lists(int64s, min_size=0, max_size=8)),
    st.tuples(st.just("pooled"), st.lists(int64s, min_size=0, max_size=8)),
    st.tuples(st.just("reopen"), st.just([])),
), min_size=1, max_size=8)


def _run_model(stack: str, rows: int, hash_cfg: dict, row_of, program, mapping_src: Path | None = None) -> None:
    """Run ``program`` on a hashed table and on a dict keyed by ``row_of(id)``; unwritten rows read as in a
    twin store that is never written (the documented deterministic initial values)."""
    with tempfile.TemporaryDirectory() as d:
        cfg = _config(stack, rows, hash_cfg)
        store = embstore.create(Path(d) / "s", cfg)
        twin = embstore.create(Path(d) / "twin", cfg)
        try:
            model: dict[int, np.ndarray] = {}
            rng = np.random.default_rng(len(program))

            def expect(ids: list[int]) -> np.ndarray:
                hashed = [row_of(x) for x in ids]
                missing = sorted({r for r in hashed if r not in model})
                init = dict(zip(missing, twin["t"].read_physical(arr(missing)))) if missing else {}
                return np.array([model.get(r, init.get(r)) for r in hashed], np.float32).reshape(len(ids), DIM)

            for op, ids in program:
                t = store["t"]
                a = arr(ids)
                assert np.array_equal(t.physical_rows(a), arr(row_of(x) for x in ids))
                if op == "update":
                    vals = rng.standard_normal((len(ids), DIM)).astype(np.float32)
                    t.update(a, vals)
                    for x, v in zip(ids, vals):  # in order: for ids hashed together the last one wins
                        model[row_of(x)] = v
                elif op == "lookup":
                    assert np.array_equal(t.lookup(a), expect(ids))
                elif op == "pooled":
                    cut = len(ids) // 2
                    offs = arr([0, cut, cut, len(ids)])
                    want = expect(ids)
                    sums = np.stack([want[:cut].sum(0), np.zeros(DIM, np.float32), want[cut:].sum(0)])
                    np.testing.assert_allclose(t.lookup_pooled(a, offs), sums, rtol=1e-6, atol=1e-6)
                    means = np.stack([want[:cut].mean(0) if cut else np.zeros(DIM), np.zeros(DIM),
                                      want[cut:].mean(0) if len(ids) > cut else np.zeros(DIM)])
                    np.testing.assert_allclose(t.lookup_pooled(a, offs, mode="mean"), means, rtol=1e-6, atol=1e-6)
                else:
                    store.close()
                    store = embstore.open(Path(d) / "s")
            every = [x for _, ids in program for x in ids]
            assert np.array_equal(store["t"].lookup(arr(every)), expect(every))
        finally:
            store.close()
            twin.close()


# -- mod through tables --------------------------------------------------------------------

@settings(max_examples=12, deadline=None)
@given(stack=st.sampled_from(STACKS), rows=st.sampled_from([1, 2, 5, 97]), seed=st.sampled_from([0, 1, 2**63 - 1]),
       program=ops)
def test_mod_hashed_table_agrees_with_a_dict_keyed_by_the_hashed_row(stack, rows, seed, program):
    """Ids collide exactly when the reference says so; a write to one is read by all (buckets of 1: every
    id shares the one row)."""
    _run_model(stack, rows, {"kind": "mod", "seed": seed}, lambda x: ref_mod(x, rows, seed), program)


@settings(max_examples=4, deadline=None)
@given(program=ops, seed=st.integers(0, 5))
def test_mod_buckets_far_beyond_the_id_space_keep_every_id_apart(program, seed):
    """2**40 rows (a sparse RocksDB home) for a handful of ids: no collisions, same contract."""
    rows = 2**40
    _run_model("rocksdb", rows, {"kind": "mod", "seed": seed}, lambda x: ref_mod(x, rows, seed), program)


# -- learned through tables ----------------------------------------------------------------

_FIT_POOL = arr([I64_MIN, I64_MIN + 1, -7, -1, 0, 1, 2, 3, 5, 8, 13, 2**40, I64_MAX - 1, I64_MAX])


@settings(max_examples=8, deadline=None)
@given(stack=st.sampled_from(STACKS), buckets=st.sampled_from([2, 3, 6, 40]),
       picks=st.lists(st.integers(0, len(_FIT_POOL) - 1), min_size=1, max_size=60), program=ops)
def test_learned_hashed_table_agrees_with_a_dict_keyed_by_the_hashed_row(stack, buckets, picks, program):
    trace = _FIT_POOL[picks]
    fitted = LearnedHash.fit(trace, buckets, seed=3)
    known = dict(zip(*(a.tolist() for a in fitted.known_ids())))

    def row_of(x: int) -> int:
        if x in known:
            return known[x]
        return fitted.reserved_start + ref_mod(x, fitted.reserved_rows, 3)

    with tempfile.TemporaryDirectory() as d:
        fitted.save(Path(d) / "m.ehash")
        _run_model(stack, buckets, {"kind": "learned", "mapping": str(Path(d) / "m.ehash")}, row_of, program)


# -- QR through tables ---------------------------------------------------------------------

@settings(max_examples=10, deadline=None)
@given(stack=st.sampled_from(("dram-whole", "dram-part", "device-whole", "mmap")),
       shape=st.sampled_from([(2, 1), (5, 1), (9, 3), (20, 4), (12, 11)]),
       combine=st.sampled_from(["mult", "add", "concat"]), ids=st.lists(int64s, min_size=0, max_size=12),
       data=st.data())
def test_qr_table_combines_the_reference_quotient_and_remainder_rows(stack, shape, combine, ids, data):
    buckets, m = shape
    pdim = DIM // 2 if combine == "concat" else DIM
    with tempfile.TemporaryDirectory() as d:
        store = embstore.create(Path(d) / "s", _config(stack, buckets, {"kind": "qr", "collisions": m,
                                                                         "combine": combine}))
        try:
            t = store["t"]
            written = sorted(set(data.draw(st.lists(st.integers(0, buckets - 1), max_size=buckets))))
            phys = t.read_physical(np.arange(buckets, dtype=np.int64))
            if written:
                new = np.random.default_rng(buckets).standard_normal((len(written), pdim)).astype(np.float32)
                t.write_physical(arr(written), new)
                phys[written] = new
            pairs = [ref_qr(x, buckets, m) for x in ids]
            want_rows = arr(v for p in pairs for v in p).reshape(-1, 2)
            assert np.array_equal(t.physical_rows(arr(ids)).reshape(-1, 2), want_rows)
            q, r = phys[[p[0] for p in pairs]], phys[[p[1] for p in pairs]]
            want = {"mult": q * r, "add": q + r, "concat": np.concatenate([q, r], axis=1)}[combine]
            want = want.reshape(len(ids), DIM)
            np.testing.assert_array_equal(t.lookup(arr(ids)), want)
            cut = len(ids) // 3
            offs = arr([0, cut, len(ids)])
            np.testing.assert_allclose(t.lookup_pooled(arr(ids), offs),
                                       np.stack([want[:cut].sum(0), want[cut:].sum(0)]), rtol=1e-6, atol=1e-6)
            if ids:
                with pytest.raises(InvalidInputError, match="QR"):
                    t.update(arr(ids), np.zeros((len(ids), DIM), np.float32))
        finally:
            store.close()


@pytest.mark.parametrize("combine", ["mult", "add", "concat"])
def test_qr_pooled_lookup_of_no_ids_is_zeros_not_a_raw_reshape_error(tmp_path, combine):
    """Bags that are all empty on a QR table: ``combine`` reshaped (0, 2, d) with -1, which numpy and torch
    refuse for 0 elements (a raw ValueError / RuntimeError), for 'concat'."""
    import torch

    with embstore.create(tmp_path / "s", _config("dram-part", 9, {"kind": "qr", "collisions": 3,
                                                                   "combine": combine})) as store:
        t = store["t"]
        empty = np.empty(0, np.int64)
        assert np.array_equal(t.lookup_pooled(empty, arr([0, 0, 0])), np.zeros((2, DIM), np.float32))
        assert t.lookup_pooled(torch.from_numpy(empty), torch.zeros(2, dtype=torch.int64)).shape == (1, DIM)
        assert t.lookup(empty).shape == (0, DIM)
    q = QRHash(9, 3, combine)
    pdim = q.physical_dim(DIM)
    assert q.combine(np.zeros((0, 2, pdim), np.float32)).shape == (0, DIM)
    assert tuple(q.combine(torch.zeros(0, 2, pdim)).shape) == (0, DIM)


# -- learned mappers against the documented layout -------------------------------------------

@settings(max_examples=40, deadline=None)
@given(picks=st.lists(st.integers(0, len(_FIT_POOL) - 1), min_size=0, max_size=80),
       buckets=st.integers(2, 30), dedicated=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
       reserved=st.sampled_from([0.0, 0.05, 0.5, 0.9]), seed=st.integers(0, 3),
       probe=st.lists(int64s, max_size=30))
def test_learned_mapping_follows_the_documented_layout_and_survives_save_load(picks, buckets, dedicated, reserved,
                                                                               seed, probe):
    trace = _FIT_POOL[picks]
    uniq, counts = np.unique(trace, return_counts=True)
    try:
        h = LearnedHash.fit(trace, buckets, dedicated_fraction=dedicated, reserved_fraction=reserved, seed=seed)
    except ConfigError as e:  # only when the reserved share leaves no row (documented: at least one is left)
        assert e.key == "reserved_fraction" and buckets - max(1, math.ceil(reserved * buckets)) < 1
        return
    ded, clu = ref_layout(len(uniq), buckets, dedicated, reserved)
    assert (h.dedicated, h.cluster_rows, h.reserved_start, h.num_rows) == (ded, clu, ded + clu, buckets)
    assert h.reserved_rows >= 1
    hottest = sorted(zip((-counts).tolist(), uniq.tolist()))  # most accessed first, ties by id
    rows = dict(zip(uniq.tolist(), h(uniq).tolist()))
    for rank, (_, x) in enumerate(hottest):
        if rank < ded:
            assert rows[x] == rank
        else:
            assert ded <= rows[x] < ded + clu
    if clu:  # every clustered row holds some id (the balanced split leaves none empty)
        assert set(range(ded, ded + clu)) <= set(rows.values())
    probe_ids = arr(probe + uniq.tolist())
    want = [rows[x] if x in rows else h.reserved_start + ref_mod(x, h.reserved_rows, seed) for x in probe_ids.tolist()]
    got = h(probe_ids)
    assert got.tolist() == want and (got.size == 0 or (got.min() >= 0 and got.max() < buckets))
    with tempfile.TemporaryDirectory() as d:
        h.save(Path(d) / "m")
        assert LearnedHash.load(Path(d) / "m")(probe_ids).tolist() == want


_OTHER_PROCESS = """
import json, sys
import numpy as np
from embstore.hashing import LearnedHash
print(json.dumps(LearnedHash.load(sys.argv[1])(np.array(json.loads(sys.argv[2]), np.int64)).tolist()))
"""


def test_a_saved_mapping_maps_the_same_in_another_process(tmp_path):
    rng = np.random.default_rng(5)
    trace = np.concatenate([rng.zipf(1.3, 3000).astype(np.int64) * -977, arr(EDGES)])
    h = LearnedHash.fit(trace, 64, seed=11)
    h.save(tmp_path / "m.ehash")
    probe = EDGES + trace[:300].tolist() + rng.integers(I64_MIN, I64_MAX, 300, endpoint=True).tolist()
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", _OTHER_PROCESS, str(tmp_path / "m.ehash"), json.dumps(probe)],
                         capture_output=True, text=True, check=True, timeout=300, env=env)
    known = dict(zip(*(a.tolist() for a in h.known_ids())))
    want = [known.get(x, h.reserved_start + ref_mod(x, h.reserved_rows, 11)) for x in probe]
    assert json.loads(out.stdout) == want == h(arr(probe)).tolist()


# -- damaged and mismatched mapping files ------------------------------------------------------

def _small_mapping(path: Path, buckets: int = 16) -> LearnedHash:
    trace = np.random.default_rng(0).zipf(1.5, 400).astype(np.int64)
    h = LearnedHash.fit(np.concatenate([trace, arr(EDGES)]), buckets, seed=2)
    h.save(path)
    return h


def test_every_truncation_and_every_single_byte_flip_is_refused_or_harmless(tmp_path):
    """A damaged mapping never loads as another mapping: CorruptStoreError naming the file, or (padding
    bytes only) exactly the same mapping."""
    path = tmp_path / "m.ehash"
    h = _small_mapping(path)
    good = path.read_bytes()
    probe = np.concatenate([h.known_ids()[0], np.arange(-40, 40, dtype=np.int64), arr(EDGES)])
    want = h(probe)
    for n in range(len(good)):
        path.write_bytes(good[:n])
        with pytest.raises(CorruptStoreError, match="m.ehash"):
            LearnedHash.load(path)
    import struct

    (hlen,) = struct.unpack("<Q", good[8:16])
    data_start = -(-(16 + hlen) // 64) * 64
    covered = set(range(16 + hlen))  # magic, length, header
    for d in json.loads(good[16:16 + hlen])["arrays"].values():
        start = data_start + d["offset"]
        covered.update(range(start, start + np.dtype(d["dtype"]).itemsize * math.prod(d["shape"])))
    crc_key = good.index(b'}}, "crc32": ') + 4  # the header's top-level key (sorted: arrays, crc32, meta)
    rng = np.random.default_rng(1)
    for i in range(len(good)):
        data = bytearray(good)
        data[i] ^= 1 << int(rng.integers(8))
        path.write_bytes(bytes(data))
        try:
            m = LearnedHash.load(path)
        except CorruptStoreError as e:
            assert "m.ehash" in str(e)
            continue
        assert m.num_rows == h.num_rows and np.array_equal(m(probe), want), i
        # alignment padding, or the name of the header's own "crc32" key (optional: files written before it
        # had one load without it), may change without notice: the mapping is the same
        assert (i not in covered and good[i] == 0) or crc_key <= i < crc_key + len(b'"crc32"'), i


def _learned_config(mapping: Path, rows: int, name: str = "t") -> StoreConfig:
    return StoreConfig((TableConfig(name, rows, DIM, hash={"kind": "learned", "mapping": str(mapping)},
                                    tiers=(TierConfig("mmap"),)),))


def test_a_mapping_of_another_bucket_count_is_refused_at_create_and_at_reopen(tmp_path):
    _small_mapping(tmp_path / "m16.ehash", 16)
    _small_mapping(tmp_path / "m17.ehash", 17)
    for rows in (15, 17, 1):
        with pytest.raises(ConfigError) as e:
            embstore.create(tmp_path / f"s{rows}", _learned_config(tmp_path / "m16.ehash", rows))
        assert e.value.key == "hash.mapping" and "16" in str(e.value) and str(rows) in str(e.value)
        assert not (tmp_path / f"s{rows}").exists()
    embstore.create(tmp_path / "s", _learned_config(tmp_path / "m16.ehash", 16)).close()
    inside = tmp_path / "s" / "tables" / "t" / "hash.ehash"
    good = inside.read_bytes()
    inside.write_bytes((tmp_path / "m17.ehash").read_bytes())  # another table's mapping, of 17 rows
    with pytest.raises(ConfigError) as e:
        embstore.open(tmp_path / "s")
    assert e.value.key == "hash.mapping" and "17" in str(e.value) and "16" in str(e.value)
    for damaged in (good[: len(good) - 8], good[:200] + bytes([good[200] ^ 0x10]) + good[201:], b""):
        inside.write_bytes(damaged)
        with pytest.raises(CorruptStoreError, match="hash.ehash"):
            embstore.open(tmp_path / "s")
    inside.unlink()
    with pytest.raises(ConfigError, match="hash.ehash"):
        embstore.open(tmp_path / "s")
    inside.write_bytes(good)
    with embstore.open(tmp_path / "s") as s:  # whole again: opens
        assert s["t"].num_rows == 16


def test_a_damaged_mapping_is_refused_at_create_naming_it(tmp_path):
    path = tmp_path / "m.ehash"
    _small_mapping(path)
    good = path.read_bytes()
    path.write_bytes(good[:-1])
    with pytest.raises(CorruptStoreError, match="hash.ehash"):
        embstore.create(tmp_path / "s", _learned_config(path, 16))
    assert not (tmp_path / "s").exists()


# -- buckets of 1 and bad bucket counts ------------------------------------------------------

def test_a_single_bucket_and_bucket_counts_below_it_are_handled_by_each_mapper():
    from embstore.hashing import ModHash

    ids = arr(EDGES)
    assert ModHash(1, 5)(ids).tolist() == [0] * len(ids)
    for call, key in [(lambda: ModHash(0), "buckets"), (lambda: QRHash(1, 1), "buckets"),
                      (lambda: LearnedHash.fit(ids, 1), "buckets"), (lambda: LearnedHash.fit(ids, 0), "buckets")]:
        with pytest.raises(ConfigError) as e:
            call()
        assert e.value.key == key


# -- hash fit -----------------------------------------------------------------------------------

def test_hash_fit_refuses_zero_buckets_and_gives_every_id_a_row_when_buckets_exceed_them(tmp_path, capsys):
    from embstore.commands.hash_cmds import main

    ids = arr([5, 5, 9, -3, I64_MAX, I64_MIN, 5, 9])
    np.save(tmp_path / "ids.npy", ids)
    out = tmp_path / "m.ehash"
    for bad in ("0", "-3"):
        assert main(["hash", "fit", str(tmp_path / "ids.npy"), "--buckets", bad, "--out", str(out), "--quiet"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "--buckets" in err and bad in err and not out.exists()
    assert main(["hash", "fit", str(tmp_path / "ids.npy"), "--buckets", "1000", "--out", str(out), "--quiet"]) == 0
    assert "1000 rows" in capsys.readouterr().out
    h = LearnedHash.load(out)
    # 5 (3 accesses), 9 (2), then one access each by id: I64_MIN, -3, I64_MAX
    assert h(arr([5, 9, I64_MIN, -3, I64_MAX])).tolist() == [0, 1, 2, 3, 4]
    assert (h.dedicated, h.cluster_rows, h.reserved_start) == (5, 0, 5)
    unseen = arr([0, 1, -1, 6, 2**40])
    assert h(unseen).tolist() == [5 + ref_mod(x, 995, 0) for x in unseen.tolist()]


# -- fit inputs the validation accepts must not crash the fit ------------------------------------

def test_counts_whose_total_overflows_are_a_config_error_not_a_raw_overflow():
    """Finite counts of 1e308 passed the counts check, then ``int(counts.sum())`` (inf) raised a raw
    OverflowError while logging the total."""
    ids = np.arange(10, dtype=np.int64)
    with pytest.raises(ConfigError) as e:
        LearnedHash.fit((ids, np.full(10, 1e308)), 5)
    assert e.value.key == "counts"
    big = LearnedHash.fit((ids, np.full(10, 2.0**50)), 5)  # large but summable: fine
    assert big(ids).max() < 5


@pytest.mark.parametrize("scale", [1e200, 1.7e308])
def test_vectors_too_large_to_cluster_are_a_config_error_not_a_linalg_error(scale):
    """Finite vectors passed the vectors check, then the clustering's covariance overflowed to inf and
    numpy's eigh raised a raw LinAlgError."""
    ids = np.arange(10, dtype=np.int64)
    vectors = np.array([[scale * ((i % 3) - 1), 1.0] for i in range(10)])
    with pytest.raises(ConfigError) as e:
        LearnedHash.fit((ids, np.ones(10)), 5, vectors=vectors, dedicated_fraction=0.0)
    assert e.value.key == "vectors"
    ok = LearnedHash.fit((ids, np.ones(10)), 5, vectors=vectors / scale * 1e6, dedicated_fraction=0.0)
    assert ok(ids).max() < 5

