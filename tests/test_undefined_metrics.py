"""Metrics undefined on degenerate input print as 'undefined' and are null in strict JSON, never 'nan'.

AUC and NE have no value when the held-out labels are all one class (NE's baseline, the entropy of the
click rate, is 0 there); a benchmark's latency percentile has none over a window that measured no request.
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
    latency percentile over a window that measured no request is float('nan')), also as numpy scalars and
    inside arrays, which the writer's ``default`` turned into floats after the NaN check."""
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
