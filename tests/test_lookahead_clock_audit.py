"""Audit: the store's look-ahead clock under a training pipeline (``pipeline(..., lookahead=k, announce=A)``).

Found: ``replay --announce`` / ``simulate(announce=K)`` model a store whose every batch is read whole at its
own clock tick. A pipeline's store sees something else: its working set holds every row of the batches in its
window, so batch j's fetch reads only the rows none of batches j-k .. j-1 uses, on the prefetch thread k
batches before its step, and rows leaving the working set are written back (directory accesses too). The
pipeline told each table the whole batch and advanced after the step, so a row fetched at j-k stayed ranked
as "needed at j" for k more batches (told k = 1..3, lfu+tinylfu got *fewer* hits than told nothing), and the
clock raced the prefetch thread (hits depended on timing). Now the pipeline tells a table exactly the rows
its fetch will read and ticks the clock on the prefetch thread right before each fetch; write-backs go in
key order; ``embstore.simulator.simulate_pipeline`` replays that sequence, and a pipeline's top-cache hits
equal it exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import embstore
from embstore.config import StoreConfig, TableConfig, TierConfig
from embstore.errors import InvalidInputError
from embstore.simulator import pipeline_accesses, simulate_pipeline
from embstore.training import TieredEmbeddingBagCollection

DIM = 4
RB = 4 * DIM  # float32 rows, sgd: no optimizer state
POLICIES = ["lru", "lfu", "clock", "lru+tinylfu", "lfu+tinylfu", "clock+tinylfu"]


def _store(path, tables: list[tuple[str, int, int, str, bool]], home: str = "mmap"):
    """Tables (name, rows, cache rows, policy, hashed) with one DRAM cache each over ``home``."""
    return embstore.create(path, StoreConfig(tuple(
        TableConfig(name=n, num_embeddings=rows, dim=DIM, tiers=(TierConfig("dram", cap * RB, pol), TierConfig(home)),
                    **({"hash": {"kind": "mod"}} if hashed else {}))
        for n, rows, cap, pol, hashed in tables)))


def _train(store, names: list[str], batches: list[list[np.ndarray]], k: int, ahead: int, trained: bool = True,
           stop: int | None = None) -> TieredEmbeddingBagCollection:
    """Run ``batches`` (per batch: one id array per table, one id per bag) through a pipeline."""
    ebc = TieredEmbeddingBagCollection(store, names, optimizer="sgd", lr=0.5)
    if not trained:
        ebc.eval()

    def sparse(b):
        return [torch.from_numpy(x) for x in b], [torch.tensor([0, len(x)]) for x in b]
    for i, b in enumerate(ebc.pipeline(batches, lookahead=k, announce=ahead, sparse=sparse)):
        out = ebc(*sparse(b))
        if trained:
            (out * torch.arange(1, DIM + 1, dtype=torch.float32)).sum().backward()
        if stop is not None and i == stop:
            break
    ebc.release()
    return ebc


def _trace(batches: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    return (np.concatenate(batches) if batches else np.zeros(0, np.int64),
            np.cumsum([0] + [len(b) for b in batches]).astype(np.int64))


def _predicted(batches: list[np.ndarray], cap: int, policy: str, k: int, ahead: int, trained: bool) -> tuple:
    hit = simulate_pipeline(*_trace(batches), cap, policy, lookahead=k, announce=ahead, trained=trained)
    return int(hit.sum()), int(hit.size - hit.sum())


BATCH = st.lists(st.integers(0, 47), min_size=1, max_size=14).map(lambda x: np.array(x, np.int64))


@settings(max_examples=60, deadline=None)
@given(st.lists(BATCH, min_size=1, max_size=12), st.integers(0, 3), st.integers(0, 4), st.integers(1, 30),
       st.sampled_from(POLICIES), st.booleans())
def test_a_pipelines_cache_hits_are_the_simulators(tmp_path_factory, batches, k, ahead, cap, policy,
                                                   trained) -> None:
    """Any small trace, lookahead, announce, capacity and policy, trained or evaluated: the top cache's hits
    and misses are ``simulate_pipeline``'s (the old pipeline's clock made them depend on the timing)."""
    with _store(tmp_path_factory.mktemp("s") / "s", [("t", 48, cap, policy, False)]) as store:
        _train(store, ["t"], [[b] for b in batches], k, ahead, trained)
        s = store["t"].stats()["dram"]
        assert (s["hits"], s["misses"]) == _predicted(batches, cap, policy, k, ahead, trained)
        assert store["t"].announced == 0


@pytest.mark.parametrize("k, ahead", [(1, 3), (2, 2), (3, 6)])
def test_two_tables_one_hashed_over_an_ssd_home(tmp_path, k, ahead) -> None:
    """Per table, over an ssd home, a mod-hashed table's ids replayed as the physical rows they land on."""
    rng = np.random.default_rng(k)
    p = 1 / np.arange(1, 301) ** 1.1
    zipf = rng.choice(300, (25, 30), p=p / p.sum())
    batches = [[row % 120, row * 7 + 1000] for row in zipf]  # table "h" hashes 1000 + 7r into 90 rows
    tables = [("a", 120, 25, "lfu+tinylfu", False), ("h", 90, 20, "lru", True)]
    with _store(tmp_path / "s", tables, home="ssd") as store:
        _train(store, ["a", "h"], batches, k, ahead)
        for t, (name, _, cap, pol, _) in enumerate(tables):
            phys = [store[name].physical_rows(b[t]) for b in batches]
            s = store[name].stats()["dram"]
            assert (s["hits"], s["misses"]) == _predicted(phys, cap, pol, k, ahead, True), name


def _zipf_batches(seed: int, n: int = 40, size: int = 40, rows: int = 400) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    p = 1 / np.arange(1, rows + 1) ** 0.9
    return [rng.choice(rows, size, p=p / p.sum()) for _ in range(n)]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_telling_a_pipeline_with_lookahead_buys_hits_and_changes_no_number(tmp_path, k) -> None:
    """Told 4 batches ahead, the cache of a pipeline with lookahead k gets more hits than told nothing (the old
    clock got fewer: each row it fetched stayed ranked as needed k batches later), and the rows trained are
    bit for bit those of the run told nothing."""
    batches = [[b] for b in _zipf_batches(k)]
    hits, rows = {}, {}
    for ahead in (0, 4):
        with _store(tmp_path / f"s{ahead}", [("t", 400, 40, "lfu+tinylfu", False)]) as store:
            _train(store, ["t"], batches, k, ahead)
            hits[ahead] = store["t"].stats()["dram"]["hits"]
            rows[ahead] = store["t"].read_physical(np.arange(400))
    assert hits[4] > hits[0] * 1.2
    np.testing.assert_array_equal(rows[4], rows[0])


def test_a_pipeline_left_early_is_told_what_its_fetches_read(tmp_path) -> None:
    """Left after the third step: the fetches that ran (up to batch 2 + k) were told up to their batch + A,
    each table advanced past all of it; the hits so far are the simulator's over the batches fetched."""
    batches = _zipf_batches(9, n=20)
    k, ahead = 2, 3
    with _store(tmp_path / "s", [("t", 400, 40, "lru+tinylfu", False)]) as store:
        _train(store, ["t"], [[b] for b in batches], k, ahead, stop=2)
        assert store["t"].announced == 0 and not store["t"].advance()
        s = store["t"].stats()["dram"]
        # the fetches of batches 0 .. 2 + k ran; the simulator told as far ahead as they were
        full = simulate_pipeline(*_trace(batches), 40, "lru+tinylfu", lookahead=k, announce=ahead)
        reads = sum(r.size for _, r, _ in pipeline_accesses(*_trace(batches[:3 + k]), k))
        assert s["hits"] + s["misses"] == reads and s["hits"] == int(full[:reads].sum())


def test_pipeline_accesses_against_a_set_model() -> None:
    """Reads: a batch's distinct rows (first occurrence) none of the k before it uses; write-backs after fetch
    j: batch j-k's rows none of j-k+1 .. j uses, in key order."""
    rng = np.random.default_rng(3)
    small = [rng.integers(0, 12, rng.integers(0, 9)) for _ in range(15)]
    # ids past any dense range too: the rows are then renumbered by a hash before the last-use pass
    for batches, k in [(small, k) for k in range(4)] + [([b * 2**58 + 7 for b in small], k) for k in (0, 2)]:
        for trained in (True, False):
            got = pipeline_accesses(*_trace(batches), k, trained)
            for j, (told, read, written) in enumerate(got):
                seen = list(dict.fromkeys(batches[j].tolist()))
                near = set().union(*[set(b.tolist()) for b in batches[max(0, j - k):j]])
                assert read.tolist() == told.tolist() == [x for x in seen if x not in near]
                want = []
                if trained and j >= k:
                    later = set().union(*[set(b.tolist()) for b in batches[j - k + 1:j + 1]])
                    want = sorted(set(batches[j - k].tolist()) - later)
                assert written.tolist() == want


def test_simulate_pipeline_refuses_bad_settings() -> None:
    keys, off = np.arange(4, dtype=np.int64), np.array([0, 2, 4])
    for kwargs in ({"lookahead": -1}, {"lookahead": 1, "announce": -2}, {"lookahead": True}):
        with pytest.raises(InvalidInputError):
            simulate_pipeline(keys, off, 2, "lru", **kwargs)
    with pytest.raises(InvalidInputError):
        simulate_pipeline(keys, off, -1, "lru", lookahead=1)
    assert simulate_pipeline(keys, off, 0, "lru", lookahead=1).tolist() == [False] * 4
