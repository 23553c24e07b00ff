"""Behaviours a mutation audit of the trace generator and the training data path found unpinned (session 11).

The generator's id permutation near 2**63 ids, its limits and progress; the Criteo reader's statistics and
options; synthetic bags, batch slices, keyed batches; the dense optimizer; loading a damaged model; sharding
limits: each test names what it pins.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import typed, types

import embstore
from embstore import tracegen, traces
from embstore.config import StoreConfig, TableConfig
from embstore.errors import CorruptStoreError, InvalidInputError, InvalidRowsError
from embstore.training import TieredEmbeddingBagCollection
from embstore.training.batch import KeyedJaggedBatch, normalize
from embstore.training.distributed import DistContext, ShardedEmbeddingBags, hashless
from embstore.training.data import CriteoReader, SyntheticClicks
from embstore.training.dlrm import DLRM, dense_optimizer
from embstore.training.optim import check_finite_gradient
from embstore.training.registry import ModelSpec, load_model, predict, save_model
from embstore.training.testing import initial_weights, make_store

INT64_MAX = 2**63 - 1


# --------------------------------------------------------------------------- tracegen
def _kernel_ids(perm: tracegen._Permutation, ranks: np.ndarray) -> np.ndarray:
    """The drift kernel's ids when nothing is replaced (keep = 1): its affine base map."""
    pair = types.UniTuple(types.int64, 2)
    moved = typed.Dict.empty(key_type=pair, value_type=types.int64)
    checked = typed.Dict.empty(key_type=pair, value_type=types.int64)
    tab = np.zeros(ranks.size, dtype=np.int32)
    return tracegen._drifted_ids(ranks, tab, np.int64(1), 1.0, np.int64(perm.a), perm.b, np.int64(perm.m),
                                 moved, checked, 0)


@given(st.integers(2**62, INT64_MAX), st.data())
@settings(max_examples=100, deadline=None)
def test_the_id_permutation_is_exact_in_id_spaces_near_int64_max(m, data):
    """rank -> (a * rank + b) mod m is computed without int64 overflow for any id space up to 2**63 - 1, in numpy
    and in the drift kernel, so it stays a bijection: ranks m-1-b and m+1-b used to share an id."""
    perm = tracegen._Permutation.draw(m, 1, np.random.default_rng(data.draw(st.integers(0, 2**32))))
    b = int(perm.b[0])
    picks = [m - 1 - b, (m + 1 - b) % m, m - b, m - 1, 0] + data.draw(st.lists(st.integers(0, m - 1), max_size=20))
    ranks = np.array(picks, dtype=np.int64)
    want = [(perm.a * r + b) % m for r in picks]
    assert perm(ranks, np.zeros(ranks.size, dtype=np.int64)).tolist() == want
    assert _kernel_ids(perm, ranks).tolist() == want


def test_the_id_permutation_of_a_top_size_id_space_hits_every_id_once():
    """Near the wrap point of rank + b, consecutive ranks map to consecutive ids, none twice, none skipped."""
    m = INT64_MAX
    perm = tracegen._Permutation(1, np.array([2**62 + 12345], dtype=np.int64), m)
    ranks = np.arange(m - 2**62 - 12345 - 8, m - 2**62 - 12345 + 8, dtype=np.int64)
    ids = perm(ranks, np.zeros(ranks.size, dtype=np.int64))
    assert np.array_equal(np.diff(ids) % m, np.ones(ranks.size - 1))
    assert np.array_equal(_kernel_ids(perm, ranks), ids)


def test_a_trace_over_the_largest_id_space_keeps_ids_in_range_and_distinct_rows_distinct():
    """ids = 2**63 - 1 works end to end: ids lie in [0, ids), and drift moves which id holds a rank but never
    merges two rows, so each table's per-batch count profile is the one without drift."""
    for drift in (0.0, 0.5):
        tr = tracegen.generate("dlrm2021", batches=3, batch_size=1100, tables=2, ids=INT64_MAX, zipf_alpha=0.0,
                               drift=drift, seed=3)
        assert tr.ids.min() >= 0 and tr.ids.max() < INT64_MAX
        plain = tracegen.generate("dlrm2021", batches=3, batch_size=1100, tables=2, ids=INT64_MAX, zipf_alpha=0.0,
                                  seed=3)
        for b in range(3):
            sl = slice(tr.batch_offsets[b], tr.batch_offsets[b + 1])
            for t in range(2):
                mine = tr.ids[sl][tr.table[sl] == t]
                ref = plain.ids[sl][plain.table[sl] == t]
                # drift moves which id holds a rank, never the counts: the same multiset of counts per table
                assert sorted(np.unique(mine, return_counts=True)[1]) == sorted(np.unique(ref, return_counts=True)[1])


def test_a_batch_may_use_every_id_of_its_table_but_not_more():
    """A profile whose rows are all seen once needs batch_size * pooling distinct ids per table: an id space of
    exactly that size works (each batch of a table is a permutation of it), one id fewer is refused."""
    once = tracegen.ReuseProfile("once", 1.0, (0.0,), (0.0,), (1,))
    tr = tracegen.generate(once, batches=2, batch_size=40, tables=2, ids=40, seed=1)
    for b in range(2):
        sl = slice(tr.batch_offsets[b], tr.batch_offsets[b + 1])
        for t in range(2):
            assert sorted(tr.ids[sl][tr.table[sl] == t].tolist()) == list(range(40))
    with pytest.raises(InvalidInputError, match="distinct ids"):
        tracegen.generate(once, batches=1, batch_size=40, tables=2, ids=39)


def test_the_most_tables_a_generated_trace_may_have():
    """tables = MAX_DEFAULT_TABLES is allowed (each gets a default name), one more is refused up front."""
    tr = tracegen.generate(zipf_alpha=1.0, batches=1, batch_size=1, tables=traces.MAX_DEFAULT_TABLES, ids=3)
    assert len(tr.table_names) == traces.MAX_DEFAULT_TABLES
    with pytest.raises(InvalidInputError, match="tables must be at most"):
        tracegen.generate(zipf_alpha=1.0, batches=1, batch_size=1, tables=traces.MAX_DEFAULT_TABLES + 1, ids=3)


def test_full_drift_gives_every_drawn_rank_a_new_occupant_each_batch():
    """drift = 1 replaces a rank's occupant every batch it is drawn, by the id of another rank: in a two-id
    space the occupant of rank 0 alternates."""
    perm = tracegen._Permutation(1, np.zeros(1, dtype=np.int64), 2)
    ranking = tracegen._DriftingRanking(perm, 1.0, seed=5)
    seen = [int(ranking.ids(np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int32), b)[0]) for b in range(1, 25)]
    assert seen == [(b % 2) for b in range(1, 25)]


def test_progress_is_called_once_per_generated_batch():
    """generate's progress callback gets 1 after each batch, in both modes (the CLI's progress bar counts it)."""
    for like in (None, "dlrm2021"):
        calls: list[int] = []
        tracegen.generate(like, zipf_alpha=1.0, batches=4, batch_size=1100, tables=2, ids=10_000,
                          progress=calls.append)
        assert calls == [1, 1, 1, 1]


# --------------------------------------------------------------------------- Criteo reader
def _criteo_line(i: int) -> str:
    """One valid line of a 3-dense, 4-sparse Criteo-like format."""
    return "\t".join([str(i % 2), str(i), "0", "1", "a", "b", "c", format(i, "x")]) + "\n"


@pytest.mark.parametrize("start, drop_last, batches, samples", [
    (0, False, 12, 57), (4, False, 12, 37), (4, True, 11, 35), (12, False, 12, 0), (20, True, 11, 0),
])
def test_reader_stats_count_lines_batches_and_yielded_samples(tmp_path, start, drop_last, batches, samples):
    """ReaderStats after a pass: every line read, every batch formed (skipped and the partial tail included,
    a dropped tail not), and only the samples yielded past ``start``."""
    lines = [_criteo_line(i) for i in range(57)]
    lines[10:10] = ["1\t2\n", "\n", "2\t1\t1\t1\ta\tb\tc\td\n"]  # short, blank, bad label
    p = tmp_path / "d.tsv"
    p.write_text("".join(lines))
    r = CriteoReader(p, 5, 3, 4, drop_last=drop_last, chunk_lines=8)
    got = list(r.iter_batches(start))
    assert sum(b.size for b in got) == samples
    assert (r.stats.lines, r.stats.batches, r.stats.samples, r.stats.malformed, r.stats.blank) == \
        (60, batches, samples, 2, 1)


@pytest.mark.parametrize("delimiter", ["\t", "\n", ""])
def test_a_multi_hot_delimiter_that_cannot_split_a_field_is_refused(tmp_path, delimiter):
    """A tab separates fields and a newline lines, and an empty delimiter splits nothing: all refused up front."""
    p = tmp_path / "d.tsv"
    p.write_text(_criteo_line(1))
    with pytest.raises(InvalidInputError, match="multi_hot_delimiter"):
        CriteoReader(p, 5, 3, 4, multi_hot_delimiter=delimiter)


# --------------------------------------------------------------------------- synthetic clicks and batches
@pytest.mark.parametrize("bag_min, bag_max", [(0, 0), (-1, 2), (3, 2)])
def test_synthetic_clicks_refuse_bag_sizes_that_cannot_hold_an_id(bag_min, bag_max):
    """Bags need 0 <= bag_min <= bag_max and bag_max >= 1: all-empty bags would give a table no ids at all."""
    with pytest.raises(InvalidInputError, match="bag_min"):
        SyntheticClicks((10, 10), batch_size=4, num_batches=1, bag_min=bag_min, bag_max=bag_max)


@given(st.integers(0, 12), st.integers(0, 12), st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_a_slice_of_a_batch_holds_the_same_samples_with_offsets_from_zero(lo, hi, seed):
    """ClickBatch.slice(lo, hi) (a rank's share of a global batch) keeps samples lo..hi-1: dense, labels and
    each bag, with offsets rebased to start at 0."""
    lo, hi = min(lo, hi), max(lo, hi)
    full = SyntheticClicks((50, 7, 1000), batch_size=12, num_batches=1, bag_min=0, bag_max=3, seed=seed).batch(0)
    part = full.slice(lo, hi)
    assert part.size == hi - lo
    assert np.array_equal(part.dense.numpy(), full.dense[lo:hi].numpy())
    assert np.array_equal(part.labels.numpy(), full.labels[lo:hi].numpy())
    for ids, offs, fids, foffs in zip(part.ids, part.offsets, full.ids, full.offsets):
        assert len(offs) == hi - lo + 1 and int(offs[0]) == 0 and int(offs[-1]) == len(ids)
        for i in range(hi - lo):
            want = fids[int(foffs[lo + i]):int(foffs[lo + i + 1])].tolist()
            assert ids[int(offs[i]):int(offs[i + 1])].tolist() == want


# --------------------------------------------------------------------------- DLRM dense side
@pytest.mark.parametrize("name, cls", [("sgd", torch.optim.SGD), ("adagrad", torch.optim.Adagrad),
                                       ("adam", torch.optim.Adam)])
def test_dense_optimizer_is_the_named_torch_optimizer_at_the_given_rate(name, cls):
    """dense_optimizer(name, params, lr) is exactly torch's optimizer of that name, with that learning rate."""
    w = torch.nn.Parameter(torch.ones(3))
    opt = dense_optimizer(name, [w], 0.37)
    assert type(opt) is cls and opt.param_groups[0]["lr"] == 0.37



# --------------------------------------------------------------------------- sparse batch inputs
@pytest.mark.parametrize("keys, values, lengths, match", [
    (["a", "b"], [1, 2, 3], [2, -1, 1, 1], "lengths must be >= 0"),
    (["a", "a"], [1, 2], [1, 0, 1, 0], "keys must be distinct"),
])
def test_a_keyed_batch_refuses_negative_lengths_and_repeated_keys(keys, values, lengths, match):
    """A negative bag length (whose sum still matches the values) and a key listed twice are input errors."""
    kjb = KeyedJaggedBatch(keys, torch.tensor(values), torch.tensor(lengths))
    with pytest.raises(InvalidInputError, match=match):
        kjb.split()


def test_per_table_inputs_need_the_same_number_of_bags():
    """Tables with different bag counts cannot form one batch of samples."""
    ids = [torch.tensor([1, 2]), torch.tensor([3])]
    with pytest.raises(InvalidInputError, match="same number of bags"):
        normalize(["a", "b"], ids, [torch.tensor([0, 1, 2]), torch.tensor([0, 1])])


# --------------------------------------------------------------------------- model registry
def _saved_model(tmp_path):
    """A store with one small saved DLRM, and its spec."""
    tiers = '[{ kind = "dram", capacity = "1MiB" }, { kind = "mmap" }]'
    store = make_store(tmp_path / "s", [("a", 20, 4), ("b", 10, 4)], tiers)
    spec = ModelSpec(("a", "b"), 4, 3, (8, 4), (8, 1))
    torch.manual_seed(0)
    model = DLRM(TieredEmbeddingBagCollection(store, ["a", "b"]), 2, 4, 3, spec.dense_arch, spec.over_arch)
    return store, save_model(store.path, "m", spec, model)


def test_a_model_missing_dense_parameters_is_corrupt(tmp_path):
    """dense.pt lacking a parameter is refused (CorruptStoreError), not scored with a fresh random layer."""
    store, folder = _saved_model(tmp_path)
    with store:
        dense = torch.load(folder / "dense.pt", weights_only=True)
        torch.save({k: v for i, (k, v) in enumerate(dense.items()) if i}, folder / "dense.pt")
        with pytest.raises(CorruptStoreError, match="missing"):
            load_model(store, "m")


@pytest.mark.parametrize("damage", ["model_json", "spec_key", "empty_dense", "garbage_dense", "not_a_dict",
                                    "wrong_shape"])
def test_unreadable_model_files_are_corrupt_store_errors(tmp_path, damage):
    """Whatever is wrong with model.json or dense.pt (garbage, empty, a missing field, not a state dict, a
    tensor of the wrong shape), load_model raises CorruptStoreError naming the model, never a raw
    pickle/EOF/torch error."""
    store, folder = _saved_model(tmp_path)
    with store:
        if damage == "model_json":
            (folder / "model.json").write_text("{not json")
        elif damage == "spec_key":
            (folder / "model.json").write_text('{"tables": ["a", "b"], "dense_arch": [8, 4], "over_arch": [8, 1]}')
        elif damage == "empty_dense":
            (folder / "dense.pt").write_bytes(b"")
        elif damage == "garbage_dense":
            (folder / "dense.pt").write_bytes(b"garbage")
        elif damage == "not_a_dict":
            torch.save([torch.ones(2)], folder / "dense.pt")
        else:
            dense = torch.load(folder / "dense.pt", weights_only=True)
            torch.save({k: torch.zeros(v.numel() + 1) for k, v in dense.items()}, folder / "dense.pt")
        with pytest.raises(CorruptStoreError, match="model 'm'"):
            load_model(store, "m")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_predict_refuses_non_finite_dense_features(tmp_path, bad):
    """A NaN or infinite dense feature is an input error, not a NaN score."""
    store, _ = _saved_model(tmp_path)
    with store:
        model = load_model(store, "m")
        dense = torch.zeros(2, 3)
        ids, offs = [torch.tensor([1, 2])] * 2, [torch.tensor([0, 1, 2])] * 2
        assert predict(model, dense, ids, offs).shape == (2,)
        dense[1, 2] = bad
        with pytest.raises(InvalidInputError, match="finite"):
            predict(model, dense, ids, offs)


# --------------------------------------------------------------------------- sharded training
def test_sharded_training_refuses_a_hash_with_several_rows_per_id(tmp_path):
    """A QR-hashed table pools several rows per id, which row sharding cannot split: refused by name."""
    cfg = TableConfig.from_dict({"name": "t", "num_embeddings": 20, "dim": 2, "hash": {"kind": "qr", "collisions": 4},
                                 "tiers": [{"kind": "mmap"}]})
    with embstore.create(tmp_path / "s", StoreConfig((hashless(cfg),))) as store:
        with pytest.raises(InvalidInputError, match="table 't': sharded training supports one row per id"):
            ShardedEmbeddingBags(store, [cfg], DistContext(0, 1))


# --------------------------------------------------------------------------- sparse optimizer checks
def test_a_finite_gradient_whose_sum_overflows_is_not_refused():
    """The NaN/inf check sums the gradient first; finite values whose float32 sum overflows pass, and only a
    real NaN or inf is refused."""
    check_finite_gradient(torch.tensor([[3e38, 3e38], [-1.0, 2.0]]), "t")
    for bad in (float("nan"), float("inf")):
        with pytest.raises(InvalidRowsError, match="table 't': the gradient holds 1 NaN or inf"):
            check_finite_gradient(torch.tensor([[3e38, bad], [-1.0, 2.0]]), "t")


def test_release_writes_the_trained_rows_home_and_counts_them(tmp_path):
    """release() without a flush first leaves every updated row of a bounded working set stored at home, each
    counted once in stats()["written_back_rows"]."""
    store = make_store(tmp_path / "s", [("a", 100, 4)], '[{ kind = "dram", capacity = 640 }, { kind = "mmap" }]')
    with store:
        init = initial_weights(store, "a")
        ebc = TieredEmbeddingBagCollection(store, ["a"], optimizer="sgd", lr=0.5)
        ebc([torch.tensor([1, 2, 3, 2])], [torch.tensor([0, 2, 4])]).sum().backward()
        ebc.release()
        assert ebc.stats()["written_back_rows"] == 3
        rows = store["a"].read_with_state(np.arange(100, dtype=np.int64))[0]
        want = init.copy()
        want[[1, 3]] -= 0.5
        want[2] -= 1.0  # in two bags
        np.testing.assert_allclose(rows, want, rtol=1e-6)


@pytest.mark.parametrize("where", ["constructor", "pipeline"])
@pytest.mark.parametrize("bad", [True, -1, 1.5, "2"])
def test_lookahead_must_be_a_plain_non_negative_integer(tmp_path, where: str, bad) -> None:
    """``lookahead=True`` would silently mean one batch; a bool, a negative, a float or a string is refused
    (mutation e8: the bool check dropped)."""
    from embstore.errors import InvalidInputError
    from embstore.training import TieredEmbeddingBagCollection
    from embstore.training.testing import make_store

    store = make_store(tmp_path / "s", [("a", 16, 4)], '[{ kind = "dram", capacity = "1MiB" }, { kind = "mmap" }]')
    try:
        with pytest.raises(InvalidInputError, match="lookahead must be an integer >= 0"):
            if where == "constructor":
                TieredEmbeddingBagCollection(store, ["a"], lookahead=bad)
            else:
                ebc = TieredEmbeddingBagCollection(store, ["a"])
                try:
                    next(iter(ebc.pipeline([], lookahead=bad)), None)
                finally:
                    ebc.release()
    finally:
        store.close()
