"""`embstore tune` without --out prints the recommended TOML after its summary (SPEC 7: tune writes its
recommendation as TOML); before, it printed only the summary and the recommendation was lost."""

from __future__ import annotations

import json

import pytest

from embstore import tracegen, traces
from embstore.cli import main
from embstore.config import StoreConfig

MARK = "# recommended store config"
ARGS = ["--dram", "64KiB", "--device", "8KiB", "--dim", "16"]


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("tr") / "t.npz"
    traces.save(tracegen.generate(zipf_alpha=1.0, batches=10, batch_size=300, tables=3, ids=5000, seed=2), p)
    return p


def test_tune_without_out_prints_the_toml_that_out_writes_and_create_accepts(trace_path, tmp_path, capsys):
    assert main(["tune", str(trace_path), *ARGS]) == 0
    out = capsys.readouterr().out
    summary, sep, toml = out.partition(MARK)
    assert sep and "all-DRAM" in summary and "[[table]]" not in summary  # the summary comes first
    printed = StoreConfig.from_toml(sep + toml)
    assert len(printed.tables) == 3
    written = tmp_path / "store.toml"  # the same run with --out writes the same config, and prints none
    assert main(["tune", str(trace_path), *ARGS, "--out", str(written)]) == 0
    out = capsys.readouterr().out
    assert MARK not in out and "[[table]]" not in out and f"wrote {written}" in out
    assert StoreConfig.from_toml(written) == printed
    saved = tmp_path / "printed.toml"
    saved.write_text(sep + toml)
    assert main(["create", str(tmp_path / "s"), "--config", str(saved)]) == 0
    assert StoreConfig.from_toml(tmp_path / "s" / "config.toml") == printed


def test_tune_json_prints_one_json_object_and_no_toml(trace_path, capsys):
    assert main(["tune", str(trace_path), *ARGS, "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)  # the whole of stdout: no TOML after it
    assert rec["out"] is None and len(rec["tables"]) == 3


def test_tune_help_says_where_the_toml_goes(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["tune", "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "without it, the TOML is printed after the summary" in out
