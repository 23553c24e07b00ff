"""The benchmark scripts' command lines and their cheap paths: the commands BENCHMARKS.md records still
parse, counts a script divides by are checked, tiny sizes run, and `embstore bench` survives a failing one."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cache_refs import best_reads_served, optimum_with_bypass

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "tools" / "bench"
sys.path.insert(0, str(BENCH))


def _script(rel: str):
    """The module of a script under the repository root (``tools/bench/bench_x.py``), imported once."""
    name = "benchtest_" + Path(rel).stem
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / rel)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


class _Parsed(Exception):
    pass


def _parse(rel: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """What ``rel``'s main makes of ``argv``, without running the benchmark (SystemExit on a usage error)."""
    real = argparse.ArgumentParser.parse_args

    def parse_only(self, args=None, namespace=None):
        raise _Parsed(real(self, args, namespace))

    module = _script(rel)
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_only)
        try:
            module.main(argv)
        except _Parsed as parsed:
            return parsed.args[0]
    raise AssertionError(f"{rel} ran instead of parsing")


def _recorded_commands() -> list[tuple[str, list[str]]]:
    """(script, argv) of every ``python ...`` command quoted in BENCHMARKS.md; ``[--opt x]`` parts included."""
    text = (ROOT / "BENCHMARKS.md").read_text()
    out = []
    for cmd in re.findall(r"`(python\s+(?:-m\s+)?tools[^`]*)`", text):
        words = shlex.split(cmd.replace("[", " ").replace("]", " "))
        if words[1] == "-m":
            out.append((words[2].replace(".", "/") + ".py", words[3:]))
        else:
            out.append((words[1], words[2:]))
    return [(s, list(a)) for s, a in dict.fromkeys((s, tuple(a)) for s, a in out)]


COMMANDS = _recorded_commands()


def test_benchmarks_md_quotes_commands() -> None:
    scripts = {s for s, _ in COMMANDS}
    assert len(COMMANDS) >= 25 and "tools/bench/bench_dlrm.py" in scripts and "tools/eval_hashing.py" in scripts


@pytest.mark.parametrize("script,argv", COMMANDS, ids=[" ".join([s, *a]) for s, a in COMMANDS])
def test_recorded_command_parses(script: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _parse(script, argv, monkeypatch)


def test_dlrm_rounds_is_the_older_name_of_windows(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _parse("tools/bench/bench_dlrm.py", ["--quick", "--cold", "--rounds", "3"], monkeypatch).windows == 3


@pytest.mark.parametrize("script,argv", [
    ("bench_flush.py", ["--repeats", "0"]),  # printed nan ratios
    ("bench_dram.py", ["--repeats", "0"]),  # division by zero
    ("bench_sim.py", ["--repeats", "0"]),
    ("bench_sim.py", ["--python-prefix", "0"]),
    ("bench_train_step.py", ["--repeats", "0"]),
    ("bench_tiered.py", ["--batches", "0"]),
    ("bench_server.py", ["--rate", "0"]),
    ("bench_server.py", ["--rounds", "0"]),  # medians of nothing
    ("bench_soak.py", ["--rate", "0"]),
    ("bench_writes.py", ["--rounds", "0"]),
    ("bench_writes.py", ["--concurrency", "0"]),
    ("bench_ssd.py", ["--queue-depth", "-1"]),
    ("bench_hashing.py", ["--known", "-3"]),
])
def test_counts_a_script_divides_by_must_be_positive(script: str, argv: list[str],
                                                      monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse(f"tools/bench/{script}", argv, monkeypatch)
    assert exc.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_rocksdb_batch_larger_than_the_table_is_a_usage_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _script("tools/bench/bench_rocksdb.py").main(["--rows", "100", "--rounds", "1"])
    assert exc.value.code == 2 and "--batch" in capsys.readouterr().err


def test_train_oversized_needs_a_timed_step(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        _script("tools/bench/bench_train_oversized.py").main(["--quick", "--steps", "2"])
    assert exc.value.code == 2 and "--steps" in capsys.readouterr().err


def test_hashing_runs_with_few_known_ids_and_gives_numba_threads_back() -> None:
    import numba

    before = numba.get_num_threads()
    res = _script("tools/bench/bench_hashing.py").main(["--ids", "1000", "--known", "4", "--rounds", "1"])
    assert numba.get_num_threads() == before  # `embstore bench` runs the next benchmarks in this process
    assert res["known_ids"] == 4 and all(np.isfinite(res[k]["ratio"]) for k in ("mod", "qr", "learned (uniform)"))


def test_tiered_runs_on_a_table_smaller_than_ten_rows(capsys) -> None:
    res = _script("tools/bench/bench_tiered.py").main(["--rows", "5", "--batches", "1", "--home", "mmap"])
    assert np.isfinite(res["ratio"]) and res["ratio"] > 0


def test_ssd_writes_warm_up_ends_when_puts_leave_nothing_to_clean(tmp_path: Path, capsys) -> None:
    """Every put rewrites all rows of a 100-row table, so whole blocks empty and the cleaner never runs:
    the warm-up used to wait for it forever."""
    res = _script("tools/bench/bench_ssd_writes.py").main(
        ["--rows", "100", "--seconds", "0.05", "--rounds", "1", "--cycles", "0", "--dir", str(tmp_path)])
    assert res["log_cleaned_blocks_in_warmup"] == 0 and res["log"]["rows_per_s"] > 0
    assert list(tmp_path.iterdir()) == []


def test_ssd_says_clearly_when_fio_cannot_be_installed(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    mod = _script("tools/bench/bench_ssd.py")
    which = mod.shutil.which
    monkeypatch.setattr(mod.shutil, "which", lambda name: None if name == "fio" else which(name))

    def offline(cmd, **kwargs):
        if kwargs.get("check"):
            raise subprocess.CalledProcessError(100, cmd, stderr=b"E: Unable to fetch some archives\n")
        return subprocess.CompletedProcess(cmd, 100)

    monkeypatch.setattr(mod.subprocess, "run", offline)
    with pytest.raises(SystemExit) as exc:
        mod.main(["--quick"])
    msg = str(exc.value.code)
    assert "fio" in msg and "Unable to fetch" in msg and "install fio" in msg


def _fake_benches(tmp_path: Path) -> Path:
    tmp_path.mkdir()
    (tmp_path / "bench_a_bad.py").write_text("def main(argv):\n    raise RuntimeError('baseline tool missing')\n")
    (tmp_path / "bench_b_usage.py").write_text("import sys\ndef main(argv):\n    sys.exit('b: error: no fio')\n")
    (tmp_path / "bench_c_good.py").write_text(
        "import numpy as np\n"
        "def main(argv):\n"
        "    return {'argv': argv, 'n': np.int64(3), 'ratio': np.float64(0.5), 'hits': np.arange(2)}\n")
    return tmp_path


def test_bench_verb_runs_the_others_when_one_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from embstore import cli
    from embstore.commands import bench_cmds

    monkeypatch.setattr(bench_cmds, "BENCH_DIR", _fake_benches(tmp_path / "benches"))
    out = tmp_path / "figures.json"
    assert cli.main(["bench", "--quick", "--json", str(out)]) == 1
    err = capsys.readouterr().err
    assert "a_bad failed: baseline tool missing" in err and "b_usage failed: b: error: no fio" in err
    assert "2 of 3 failed" in err
    assert json.loads(out.read_text()) == {"c_good": {"argv": ["--quick"], "n": 3, "ratio": 0.5, "hits": [0, 1]}}


def test_bench_verb_checks_the_json_path_before_running(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys) -> None:
    from embstore import cli
    from embstore.commands import bench_cmds

    monkeypatch.setattr(bench_cmds, "BENCH_DIR", _fake_benches(tmp_path / "benches"))
    assert cli.main(["bench", "c_good", "--json", str(tmp_path / "missing" / "f.json")]) == 2
    captured = capsys.readouterr()
    assert "--json" in captured.err and "== c_good ==" not in captured.out


def test_eval_hashing_bad_input_is_one_usage_line() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "eval_hashing.py"), "--quick", "--fraction", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and "error: config key 'fraction'" in proc.stderr


def _exact_lfu_reference(keys: list[int], capacity: int) -> int:
    """The module doc's exact full-history LFU, spelled out: counts of every key ever seen; a miss enters
    only when its count beats the least counted resident (the least recently used among equals)."""
    count: dict[int, int] = {}
    resident: dict[int, int] = {}  # key -> time of its last access
    hits = 0
    for now, k in enumerate(keys):
        count[k] = count.get(k, 0) + 1
        if k in resident:
            hits += 1
        elif len(resident) >= capacity:
            victim = min(resident, key=lambda r: (count[r], resident[r]))
            if count[k] <= count[victim]:
                continue
            del resident[victim]
        resident[k] = now
    return hits


@given(st.lists(st.integers(0, 12), max_size=80), st.integers(1, 6))
@settings(max_examples=60, deadline=None)
def test_exact_lfu_reference_point_matches_a_plain_python_one(keys: list[int], capacity: int) -> None:
    lfu = _script("tools/bench/bench_policies.py").exact_lfu_hits
    arr = np.array(keys, np.int64)
    k = int(arr.max()) + 1 if keys else 0
    mc = int(np.bincount(arr, minlength=k).max()) if keys else 0
    assert lfu(arr, k, mc, capacity) == _exact_lfu_reference(keys, capacity)


def test_policies_kernel_loads_however_the_script_was_loaded_before(tmp_path: Path) -> None:
    """`embstore bench policies` loads the script as a module of no importable name; a numba cache it left
    behind broke the next `python tools/bench/bench_policies.py` (No module named '<dynamic>')."""
    script = ROOT / "tools" / "bench" / "bench_policies.py"
    call = "m.exact_lfu_hits(np.array([1, 2, 1], np.int64), 3, 2, 1)"
    as_bench_verb = ("import importlib.util, numpy as np\n"
                     f"spec = importlib.util.spec_from_file_location('embstore_bench_policies', {str(script)!r})\n"
                     "m = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(m)\n" + call)
    as_script = (f"import runpy, numpy as np, types\nm = types.SimpleNamespace(**runpy.run_path({str(script)!r}))\n"
                 + call)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    for code in (as_bench_verb, as_script):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]


def _lookahead_reference(keys: list[int], offsets: list[int], capacity: int, ahead: int) -> int:
    """The module doc's ``ahead-K`` spelled out: at access i of batch b the window ends with batch b + K; a
    resident row used in the window ranks by that use, one without ranks above all of those (fewer counts,
    then older last use first); a miss displaces the top-ranked row only if it ranks below it."""
    n, nb = len(keys), len(offsets) - 1
    batch = [b for b in range(nb) for _ in range(offsets[b], offsets[b + 1])]
    after = [next((j for j in range(i + 1, n) if keys[j] == keys[i]), None) for i in range(n)]
    count: dict[int, int] = {}
    resident: dict[int, tuple[int | None, int]] = {}  # row -> (its next use, its last access)
    hits = 0
    for i, x in enumerate(keys):
        count[x] = count.get(x, 0) + 1
        end = offsets[min(batch[i] + ahead + 1, nb)]

        def in_window(use: int | None) -> bool:
            return use is not None and use < end

        def rank(r: int) -> tuple[int, int, int]:
            use, last = resident[r]
            return (0, use, 0) if in_window(use) else (1, -count[r], -last)

        if x in resident:
            hits += 1
        elif len(resident) >= capacity:
            victim = max(resident, key=rank)
            if in_window(after[i]):
                if in_window(resident[victim][0]) and after[i] > resident[victim][0]:
                    continue  # every resident row is used before x
            elif in_window(resident[victim][0]) or count[x] <= count[victim]:
                continue  # x is not used in the window: it must out-count a victim that is not either
            del resident[victim]
        resident[x] = (after[i], i)
    return hits


def _batches(draw_keys: list[int], cuts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Keys cut into batches at ``cuts`` and deduplicated per batch (each batch's first occurrences)."""
    from embstore.belady import dedup_batches

    arr = np.array(draw_keys, np.int64)
    offsets = np.array(sorted({0, len(arr), *(c for c in cuts if c < len(arr))}), np.int64)
    return dedup_batches(arr, offsets)


def _ahead(keys: np.ndarray, offsets: np.ndarray, capacity: int, ahead: int) -> int:
    from embstore.belady import next_use

    hits = _script("tools/bench/bench_policies.py").lookahead_hits
    k = int(keys.max()) + 1 if len(keys) else 0
    mc = int(np.bincount(keys, minlength=k).max()) if len(keys) else 0
    return hits(keys, offsets, next_use(keys), k, mc, capacity, ahead)


@given(st.lists(st.integers(0, 12), max_size=80), st.lists(st.integers(1, 79), max_size=12), st.integers(1, 6),
       st.integers(0, 5))
@settings(max_examples=400, deadline=None)
def test_lookahead_reference_point_matches_a_plain_python_one(keys: list[int], cuts: list[int], capacity: int,
                                                              ahead: int) -> None:
    arr, offsets = _batches(keys, cuts)
    want = _lookahead_reference(arr.tolist(), offsets.tolist(), capacity, ahead)
    assert _ahead(arr, offsets, capacity, ahead) == want


@given(st.lists(st.integers(0, 5), max_size=14), st.lists(st.integers(1, 13), max_size=5), st.integers(1, 3))
@settings(max_examples=80, deadline=None)
def test_lookahead_over_the_whole_trace_is_the_optimum(keys: list[int], cuts: list[int], capacity: int) -> None:
    """A window reaching past the last batch knows every next use: MIN with bypass, the most hits possible,
    and never fewer than classic MIN (which must admit every miss)."""
    from embstore.belady import belady_hits

    arr, offsets = _batches(keys, cuts)
    got = _ahead(arr, offsets, capacity, len(offsets))
    assert got == optimum_with_bypass(arr.tolist(), capacity)
    assert got >= belady_hits(arr, capacity)


def test_policies_bench_reports_the_store_policies_told_batches_ahead(capsys) -> None:
    """`--quick` (20 batches): told 32 batches ahead, a store policy sees the whole trace, and beats every
    online policy at each size."""
    mod = _script("tools/bench/bench_policies.py")
    out = mod.main(["--quick"])
    capsys.readouterr()
    assert set(out["announced"]) == {f"{p} K={k}" for p in mod.ANNOUNCED_POLICIES for k in mod.ANNOUNCE}
    assert all(a >= b for a, b in zip(out["best_share_announced_32"], out["best_share_of_belady"]))
    assert min(out["best_share_announced_32"]) > max(out["best_share_of_belady"])
    assert out["announced"]["lfu+tinylfu K=4"]["hit_ratio"] != out["policies"]["lfu+tinylfu"]["hit_ratio"]


def test_server_latency_over_a_window_without_requests_is_an_error() -> None:
    """bench_server printed 'nan ms' (and --json held NaN) when a window measured no request."""
    pct = _script("tools/bench/bench_server.py")._pct
    assert pct([0.001, 0.002, 0.003], 50) == pytest.approx(2.0)
    with pytest.raises(RuntimeError, match="no request completed"):
        pct([], 99)


def test_train_oversized_ceiling_is_a_floor_the_store_does_not_beat(capsys) -> None:
    """Belady's floor on the homes' reads (the caches start empty, as MIN does) is at most what the store
    read in the same run, and the ceiling it implies is a ratio no higher than 1."""
    res = _script("tools/bench/bench_train_oversized.py").main(["--quick", "--steps", "3"])
    ceiling, run = res["ceiling"], res["oversized_k"]
    assert 0 < ceiling["floor"] <= run["ssd_rows_read_in_run"]
    assert 0 < ceiling["floor_per_step"] <= ceiling["reads_per_step"]
    assert 0 < ceiling["ratio"] <= 1
    assert "ceiling (Belady's MIN" in capsys.readouterr().out


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(0, 6), min_size=3, max_size=3),
                          st.lists(st.integers(0, 6), min_size=3, max_size=3)), min_size=2, max_size=5),
       st.integers(0, 2), st.integers(1, 3))
def test_train_oversized_floor_holds_for_caches_that_decline_rows(batches, k, cap) -> None:
    """Against brute force (every choice tried): the floor is the pipeline's reads less the most a cache of
    ``cap + 1`` rows serves without bypass, which is no less than what one of ``cap`` rows that may decline
    to admit a row (as TinyLFU does) serves."""
    import torch
    from embstore.simulator import pipeline_accesses, pipeline_min_keys

    tb = [([torch.tensor(a), torch.tensor(b)], None) for a, b in batches]
    got = _script("tools/bench/bench_train_oversized.py").min_home_reads(tb, 2, k, cap, 1)
    want = bypass = 0
    for t in range(2):
        steps = pipeline_accesses(np.concatenate([b[t] for b in batches]).astype(np.int64),
                                  np.arange(0, 3 * len(batches) + 1, 3), k)
        reads = sum(r.size for _, r, _ in steps)
        want += reads - best_reads_served(steps, cap + 1)
        bypass += reads - optimum_with_bypass(pipeline_min_keys(steps).tolist(), cap)
    assert got["floor"] == want <= bypass


@given(st.lists(st.integers(0, 9), max_size=40), st.lists(st.integers(0, 5), min_size=10, max_size=10),
       st.lists(st.integers(0, 12), min_size=1, max_size=4))
@settings(max_examples=100, deadline=None)
def test_popularity_oracle_hits_match_a_plain_python_one(keys: list[int], counts: list[int], caps: list[int]) -> None:
    """A cache admitting only the c most counted rows (ties: the lower key) hits every access to them but
    the first."""
    hits = _script("tools/bench/bench_policies.py").popularity_oracle_hits
    got = hits(np.array(keys, np.int64), np.array(counts, np.int64), np.array(caps, np.int64))
    for c, g in zip(caps, got.tolist()):
        chosen = set(sorted(range(10), key=lambda r: (-counts[r], r))[:c])
        held: set[int] = set()
        want = 0
        for k in keys:
            if k in held:
                want += 1
            elif k in chosen:
                held.add(k)
        assert g == want


def test_policies_bench_oracle_never_beats_the_best_fixed_set_in_hindsight(capsys) -> None:
    """The popularity oracle is a fixed set filled on first access, so the set chosen with the trace's own
    counts hits at least as often; with drift there is no stable popularity to know, so no oracle row."""
    mod = _script("tools/bench/bench_policies.py")
    refs = mod.main(["--quick"])["references"]
    oracle, hindsight = refs["oracle-topk"]["hit_ratio"], refs["topk-hindsight"]["hit_ratio"]
    assert all(0 < o <= h for o, h in zip(oracle, hindsight))
    assert "oracle-topk" not in mod.main(["--quick", "--drift", "0.1"])["references"]
    capsys.readouterr()
