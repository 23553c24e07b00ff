"""`embstore demo --quick`: trace + tune, train, serve + score, and the files it says it wrote."""

from __future__ import annotations

import json

import numpy as np
import pytest

import embstore
from embstore import traces
from embstore.cli import main
from embstore.config import StoreConfig
from embstore.demo import QUICK, _row_bytes, run
from embstore.training.registry import list_models


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    return out, run(out, quick=True, quiet=True)


def test_served_answers_equal_direct_reads_and_the_model_learned(demo):
    _, s = demo
    assert s["served"]["rows_equal"] and s["served"]["pooled_equal"] and s["served"]["scores_equal"]
    assert s["train"]["auc"] > 0.65 and s["served"]["served_auc"] > 0.65  # chance is 0.5
    assert s["train"]["ne"] < 1.0  # better than predicting the base rate
    assert s["served"]["served_samples"] == QUICK.served_samples
    assert all(0 < x < 1 for x in s["served"]["first_scores"])
    assert s["steps"] == QUICK.steps
    # tune sized the caches for the training pipeline's reads, and the run reports what they served
    assert 0 < s["expected_dram_hit_ratio"] < 1 and 0 < s["train"]["dram_hit_ratio"] < 1
    # tables tune gives every row in DRAM are trained in place, outside both figures
    rows = {name: s["size"][f"{name}_rows"] for name in s["tuned"]}
    assert s["held_whole_in_dram"] == [n for n, p in s["tuned"].items() if p["dram_rows"] >= rows[n]]


def test_files_exist_and_hold_what_the_summary_says(demo):
    out, s = demo
    for key in ("store", "trace", "tuned_toml", "curves", "metrics", "summary", "model"):
        assert (out / s[key].split(str(out) + "/", 1)[1]).exists(), key
    assert json.loads((out / "summary.json").read_text())["train"] == s["train"]
    metrics = json.loads(open(s["metrics"]).read())
    assert metrics["evals"][-1]["auc"] == pytest.approx(s["train"]["auc"])
    assert open(s["curves"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    assert not (out / "probe_store").exists()  # the probe store is scratch

    trace = traces.load(s["trace"])
    assert list(trace.table_names) == ["user", "item", "site", "device"]
    assert trace.num_batches == QUICK.trace_batches * 4 and trace.ids.size > 0

    tuned = StoreConfig.from_toml(s["tuned_toml"])
    dram = sum(t.capacity for tc in tuned.tables for t in tc.tiers if t.kind.value == "dram")
    assert 0 < dram <= QUICK.dram_budget
    assert {tc.tiers[-1].kind.value for tc in tuned.tables} == {"ssd"}

    assert list_models(s["store"]) == ["dlrm"]
    with embstore.open(s["store"]) as store:
        user = store["user"].config
        assert [t.kind.value for t in user.tiers] == ["dram", "ssd"]
        assert user.num_embeddings * _row_bytes() >= 3 * QUICK.dram_budget  # far larger than the budget
        assert user.tiers[0].capacity == s["tuned"]["user"]["dram_rows"] * _row_bytes()
        rows = store["user"].lookup(np.arange(8, dtype=np.int64))
        assert rows.shape == (8, 16) and np.isfinite(rows).all()


def test_cli_runs_the_demo_and_refuses_a_used_folder(tmp_path, capsys):
    assert main(["demo", "--quick", "--steps", "4", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    for words in ("1. recording", "2. training", "3. serving", "4. done", "every served answer matched",
                  "curves", "tuned_toml"):
        assert words in text
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["steps"] == 4 and s["quick"] is True
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 2
    assert "already holds a demo run" in capsys.readouterr().err


def test_cli_exits_1_when_a_served_answer_differs(tmp_path, monkeypatch, capsys):
    """The demo is an end-to-end check: a mismatch used to be printed and still exit 0."""
    import embstore.demo as demo_mod

    served = {"rows_equal": True, "pooled_equal": False, "scores_equal": True}
    monkeypatch.setattr(demo_mod, "run", lambda *a, **k: {"served": served})
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 1
    assert "pooled_equal" in capsys.readouterr().err
    served["pooled_equal"] = True
    assert main(["demo", "--quick", "--out", str(tmp_path)]) == 0


def test_metrics_undefined_on_one_class_labels_print_as_such(tmp_path, monkeypatch, capsys):
    """Held-out labels of one class leave AUC and NE undefined: the demo says so (it printed 'AUC nan',
    'NE nan') and writes them as null in a summary.json that strict JSON parsers read (it wrote NaN)."""
    import dataclasses

    import embstore.training.metrics as metrics_mod
    import embstore.training.trainer as trainer_mod

    real = trainer_mod.evaluate

    def one_class(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), auc=float("nan"), ne=float("nan"), ctr=0.0)
    monkeypatch.setattr(trainer_mod, "evaluate", one_class)
    monkeypatch.setattr(metrics_mod, "auc", lambda labels, scores: float("nan"))
    assert main(["demo", "--quick", "--steps", "4", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "nan" not in text.lower()
    assert "AUC and NE undefined" in text and "served AUC undefined" in text

    def refuse(token):
        raise AssertionError(f"non-strict JSON constant {token}")
    s = json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)
    assert s["train"]["auc"] is None and s["train"]["ne"] is None and s["served"]["served_auc"] is None
