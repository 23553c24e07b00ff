"""Hash keys that do not apply to the hash kind are refused by name (SPEC 2: "Unknown keys and impossible
values are errors that name the key"); before, ``hash = { kind = "qr", seed = 3 }`` parsed and the seed was
silently dropped. Every key that does apply is kept through the store's own ``config.toml``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import embstore
from embstore.config import HashConfig, StoreConfig, TableConfig

KEYS = ("seed", "collisions", "combine", "mapping")
APPLIES = {"none": set(), "mod": {"seed"}, "qr": {"collisions", "combine"}, "learned": {"mapping"}}
VALUES = {"seed": 3, "collisions": 2, "combine": "add", "mapping": "m.ehash"}
DEFAULTS = {"seed": 0, "collisions": 4, "combine": "mult"}  # what a kind's key left out reads as
ROWS = 64


def _hash(kind: str, keys: set[str]) -> dict:
    """A hash table of ``kind`` with ``keys``; a learned hash always carries its (required) mapping."""
    data = {"kind": kind, **{k: VALUES[k] for k in sorted(keys)}}
    if kind == "learned":
        data["mapping"] = VALUES["mapping"]
    return data


def _full(data: dict) -> dict:
    """``data`` with the defaults of its kind's other keys: what the store writes back."""
    return {**{k: DEFAULTS[k] for k in APPLIES[data["kind"]] - {"mapping"}}, **data}


def _toml(hash_line: str) -> str:
    return (f'[[table]]\nname = "t"\nnum_embeddings = {ROWS}\ndim = 4\nhash = {hash_line}\n'
            'tiers = [{ kind = "mmap" }]\n')


def _toml_value(v: object) -> str:
    return f'"{v}"' if isinstance(v, str) else str(v)


def _inline(data: dict) -> str:
    return "{ " + ", ".join(f"{k} = {_toml_value(v)}" for k, v in data.items()) + " }"


MISPLACED = [(kind, key) for kind in APPLIES for key in KEYS if key not in APPLIES[kind]]
APPLYING = [(kind, key) for kind in APPLIES for key in sorted(APPLIES[kind])] + [("none", None)]


@pytest.mark.parametrize(("kind", "key"), MISPLACED)
def test_a_key_that_does_not_apply_is_refused_by_name(kind: str, key: str) -> None:
    data = _hash(kind, {key})
    with pytest.raises(embstore.ConfigError) as exc:
        HashConfig.from_dict(data)
    assert exc.value.key == f"hash.{key}"
    assert f"does not apply to a {kind!r} hash" in exc.value.reason
    with pytest.raises(embstore.ConfigError) as exc:  # the same through a whole TOML file
        StoreConfig.from_toml(_toml(_inline(data)))
    assert exc.value.key == f"hash.{key}" and f"'hash.{key}'" in str(exc.value)


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(sorted(APPLIES)), keys=st.sets(st.sampled_from(KEYS)))
def test_any_set_of_keys_parses_exactly_when_all_apply(kind: str, keys: set[str]) -> None:
    data = _hash(kind, keys)
    misplaced = sorted(set(data) - APPLIES[kind] - {"kind"})
    if misplaced:
        with pytest.raises(embstore.ConfigError) as exc:
            HashConfig.from_dict(data)
        assert exc.value.key == f"hash.{misplaced[0]}"
    else:
        h = HashConfig.from_dict(data)
        assert h.to_dict() == _full(data)  # every key given is kept, none of another kind is added
        assert HashConfig.from_dict(h.to_dict()) == h


@pytest.fixture()
def mapping_dir(tmp_path: Path) -> Path:
    """A folder holding a fitted learned-hash mapping ``m.ehash`` of ROWS buckets."""
    from embstore.hashing import LearnedHash

    trace = np.random.default_rng(0).zipf(1.3, 2000).astype(np.int64)
    LearnedHash.fit(trace, ROWS).save(tmp_path / VALUES["mapping"])
    return tmp_path


@pytest.mark.parametrize(("kind", "key"), APPLYING)
def test_a_key_that_applies_round_trips_through_the_store_config(mapping_dir: Path, kind: str, key: str | None):
    data = _hash(kind, {key} if key else set())
    (mapping_dir / "c.toml").write_text(_toml(_inline(data)))
    ids = np.arange(0, ROWS, 3, dtype=np.int64)
    with embstore.create(mapping_dir / "s", mapping_dir / "c.toml") as store:
        created = store["t"].config.hash
        rows = store["t"].lookup(ids)
    if kind == "learned":  # the store adopts its own copy of the mapping
        data["mapping"] = "tables/t/hash.ehash"
    assert created.to_dict() == _full(data)
    written = StoreConfig.from_toml(mapping_dir / "s" / "config.toml")  # what _write_config wrote parses
    assert written.tables[0].hash == created
    with embstore.open(mapping_dir / "s") as store:  # and opens with the same hash: the same rows
        assert store["t"].config.hash == created
        np.testing.assert_array_equal(store["t"].lookup(ids), rows)


def test_a_table_dict_refuses_a_misplaced_hash_key_too() -> None:
    """TableConfig takes its hash as a dict (the Python API, trainer defaults) through the same check."""
    with pytest.raises(embstore.ConfigError) as exc:
        TableConfig("t", ROWS, 4, hash={"kind": "mod", "collisions": 4})
    assert exc.value.key == "hash.collisions" and "its keys: kind, seed" in exc.value.reason
