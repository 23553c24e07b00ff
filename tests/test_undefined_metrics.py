"""Metrics undefined on degenerate input print as 'undefined' and are null in strict JSON, never 'nan'.

AUC and NE have no value when the held-out labels are all one class (NE's baseline, the entropy of the
click rate, is 0 there); a benchmark may report a NaN or infinite figure (a ratio over nothing).
Python prints such a float as 'nan' and ``json.dumps`` writes the token NaN, which strict JSON parsers
(jq, JavaScript's JSON.parse, Go's encoding/json) refuse. Each test runs a real command on such input.

Covered elsewhere: ``embstore train`` (tests/test_train_consistency_audit.py) and ``embstore demo``
(tests/test_demo.py) on one-class held-out labels.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from embstore.cli import main

ROOT = Path(__file__).resolve().parents[1]
NAN_OR_INF = re.compile(r"\b(nan|inf|infinity)\b", re.IGNORECASE)


def strict_json(text: str) -> object:
    """``text`` parsed as strict JSON: NaN, Infinity and -Infinity are refused."""
    def refuse(token: str) -> None:
        raise AssertionError(f"non-strict JSON constant {token}")
    return json.loads(text, parse_constant=refuse)


def _load_eval_hashing():
    spec = importlib.util.spec_from_file_location("eval_hashing_undefined", ROOT / "tools" / "eval_hashing.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _criteo_line(rng: np.random.Generator, label: int) -> str:
    dense = [str(int(x)) for x in rng.integers(0, 20, 13)]
    return "\t".join([str(label), *dense, *(format(int(x), "08x") for x in rng.integers(0, 30, 26))]) + "\n"


@pytest.mark.parametrize("label", [0, 1])
def test_eval_hashing_on_one_class_held_out_labels(tmp_path, capsys, label):
    """Regression: tools/eval_hashing.py printed 'AUC nan' in its progress lines and 'nan nan' in the AUC
    and NE columns of its table, and wrote NaN into --json. Line i is held out when i % 2 == 1: those
    lines all carry ``label``; the training lines carry both classes."""
    rng = np.random.default_rng(label)
    data = tmp_path / "clicks.tsv"
    data.write_text("".join(_criteo_line(rng, label if i % 2 else int(rng.integers(0, 2))) for i in range(200)))
    out = tmp_path / "figures.json"
    ev = _load_eval_hashing()
    ev.main(["--criteo", str(data), "--holdout-every", "2", "--batch-size", "50", "--epochs", "1", "--dim", "8",
             "--variants", "mod,full", "--json", str(out)])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert not NAN_OR_INF.search(text), text
    assert "undefined" in captured.out and "all one class" in captured.out  # the table says so, and why
    assert "AUC and NE undefined" in captured.err  # so do the progress lines
    results = strict_json(out.read_text())["results"]
    for r in results.values():
        assert r["auc"] is None and r["ne"] is None and r["ctr"] == label
        assert math.isfinite(r["log_loss"]) and r["log_loss"] > 0  # log loss stays defined on one class


def test_bench_json_holds_undefined_figures_as_null(tmp_path, monkeypatch, capsys):
    """Regression: ``embstore bench --json`` wrote a benchmark's undefined figure as NaN (bench_server's
    latency percentile over a window that measured no request was float('nan'); it now fails the benchmark),
    also as numpy scalars and inside arrays, which the writer's ``default`` turned into floats after the NaN
    check."""
    from embstore.commands import bench_cmds

    (tmp_path / "bench_empty.py").write_text(
        "import numpy as np\n"
        "def main(argv):\n"
        "    return {'p50_ms': float('nan'), 'p99_ms': np.float32('nan'), 'rps': np.float64(12.5),\n"
        "            'per_round': np.array([1.0, np.inf]), 'slow': float('-inf'), 'errors': np.int64(0)}\n")
    monkeypatch.setattr(bench_cmds, "BENCH_DIR", tmp_path)
    target = tmp_path / "figures.json"
    assert main(["bench", "empty", "--json", str(target)]) == 0
    assert not NAN_OR_INF.search(capsys.readouterr().out)
    figures = strict_json(target.read_text())["empty"]
    assert figures == {"p50_ms": None, "p99_ms": None, "rps": 12.5, "per_round": [1.0, None], "slow": None,
                       "errors": 0}


def test_json_safe_nulls_every_undefined_float_at_any_depth():
    from embstore.strict_json import dumps, json_safe

    value = {"a": math.nan, "b": [1.0, math.inf, (-math.inf, 2)], "c": {"d": math.nan, "e": "nan"}, "f": 3}
    assert json_safe(value) == {"a": None, "b": [1.0, None, [None, 2]], "c": {"d": None, "e": "nan"}, "f": 3}
    assert strict_json(dumps(value)) == json_safe(value)


def _trace_file(path: Path, tables: dict[str, list[list[int]]]) -> Path:
    """A trace of the given batches per table (the same number of batches each; a table may read nothing)."""
    from embstore.traces import Trace, save

    names = list(tables)
    n_batches = len(next(iter(tables.values())))
    ids, table, offsets = [], [], [0]
    for b in range(n_batches):
        for t, name in enumerate(names):
            ids += tables[name][b]
            table += [t] * len(tables[name][b])
        offsets.append(len(ids))
    save(Trace(np.array(ids, np.int64), np.array(table, np.int32), np.array(offsets, np.int64), tuple(names)),
         path)
    return path


def test_trace_stats_of_an_empty_trace_are_undefined(tmp_path, capsys):
    path = _trace_file(tmp_path / "empty.npz", {"a": [[]]})
    assert main(["trace", "stats", str(path)]) == 0
    out = capsys.readouterr().out
    assert "per batch    undefined (no lookups)" in out
    assert "re-accesses  undefined (no accesses)" in out
    assert not NAN_OR_INF.search(out) and " 0.00" not in out  # no ratio reads as measured
    assert main(["trace", "stats", str(path), "--json"]) == 0
    rec = strict_json(capsys.readouterr().out)
    assert rec["accesses"] == 0 and rec["unique_ratio"] is None and rec["dedup_factor"] is None
    assert all(b["rows_pct"] is None and b["lookups_pct"] is None for b in rec["reuse"])
    assert rec["reuse_distance"] == {"reaccess_pct": None, "p50": None, "p90": None, "p99": None, "max": None}


def test_trace_stats_without_a_reaccess_has_no_reuse_distance(tmp_path, capsys):
    path = _trace_file(tmp_path / "once.npz", {"a": [[1, 2, 2], [3, 4]]})  # 2 twice, but within one batch
    assert main(["trace", "stats", str(path), "--json"]) == 0
    rec = strict_json(capsys.readouterr().out)
    assert rec["unique_ratio"] == pytest.approx(4 / 5)
    assert rec["reuse_distance"] == {"reaccess_pct": 0.0, "p50": None, "p90": None, "p99": None, "max": None}
    assert main(["trace", "stats", str(path)]) == 0
    assert "p50, p90, p99, max: undefined (no row is accessed twice)" in capsys.readouterr().out


def test_replay_per_table_of_a_table_never_read(tmp_path, capsys):
    """Table b is in the trace but never read: its hit ratios are undefined ('-', null), table a's are not."""
    path = _trace_file(tmp_path / "t.npz", {"a": [[1, 2, 3], [1, 2, 4]], "b": [[], []]})
    args = ["replay", str(path), "--per-table", "--policy", "lru", "--capacity", "3"]
    assert main(args + ["--json"]) == 0
    recs = {r["table"]: r for r in map(strict_json, capsys.readouterr().out.splitlines())}
    assert recs["b"]["accesses"] == 0 and recs["b"]["hit_ratio"] is None and recs["b"]["belady_hit_ratio"] is None
    assert recs["a"]["accesses"] == 6 and recs["a"]["hits"] == 2 and recs["a"]["hit_ratio"] == pytest.approx(2 / 6)
    assert main(args + ["--plot", str(tmp_path / "c.png")]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[2:] if line[:2] in "a b "}
    assert rows["b"][3:6] == ["-", "-", "-"]  # hit %, belady %, of MIN
    assert rows["a"][3] == "33.33"
    assert (tmp_path / "c.png").stat().st_size > 0  # b's panel says 'no accesses' instead of a made-up curve


def test_replay_per_table_shows_a_size_once_when_fractions_round_to_it(tmp_path, capsys):
    path = _trace_file(tmp_path / "t.npz", {"a": [list(range(200))], "b": [[1, 2, 3]]})
    args = ["replay", str(path), "--per-table", "--policy", "lru,lfu", "--capacity", "0.01,0.02,0.5"]
    assert main(args + ["--json"]) == 0
    recs = [strict_json(line) for line in capsys.readouterr().out.splitlines()]
    sizes = {(r["table"], r["policy"]): [] for r in recs}
    for r in recs:
        sizes[r["table"], r["policy"]].append(r["capacity_rows"])
    for pol in ("lru", "lfu"):
        assert sizes["a", pol] == [2, 4, 100]  # 200 distinct rows: three sizes
        assert sizes["b", pol] == [1, 2]  # 3 distinct rows: 0.01 and 0.02 both round to one row
    assert main(args) == 0
    assert "table b: capacity 0.02 rounds to 1 row as an earlier one does; shown once" in capsys.readouterr().out
