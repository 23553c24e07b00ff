"""Progress off a terminal: whole lines at an interval and at the end, never carriage returns."""

from __future__ import annotations

import io

import pytest

from embstore.progress import LineProgress, progress_bar


def test_off_a_terminal_progress_prints_whole_lines() -> None:
    out = io.StringIO()
    bar = progress_bar(total=4, desc="import t", unit="row", file=out, interval=0.0)
    assert isinstance(bar, LineProgress)
    with bar:
        bar.update(1)
        bar.set_postfix(loss="0.5")
        bar.update(3)
        bar.write("step 4: AUC 0.7")
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("import t: 1/4 row (25%), ")
    assert lines[1].startswith("import t: 4/4 row (100%), ") and lines[1].endswith("loss=0.5")
    assert lines[2] == "step 4: AUC 0.7"
    assert lines[3].startswith("import t: 4/4 row (100%), ") and " in " in lines[3] and len(lines) == 4


def test_interval_transient_bars_and_failed_work_print_no_extra_lines() -> None:
    out = io.StringIO()
    with progress_bar(total=None, desc="gen", file=out, interval=3600.0) as bar:
        for _ in range(100):
            bar.update(1)
    assert out.getvalue().splitlines() == [out.getvalue().strip()] and out.getvalue().startswith("gen: 100 it, ")
    quiet = io.StringIO()
    with progress_bar(total=10, file=quiet, leave=False, interval=3600.0) as bar:
        bar.update(10)
    with pytest.raises(RuntimeError):
        with progress_bar(total=10, file=quiet) as bar:
            raise RuntimeError("disk on fire")
    with progress_bar(total=10, file=quiet, enabled=False, interval=0.0) as bar:
        bar.update(10)
    assert quiet.getvalue() == ""


def test_on_a_terminal_it_is_tqdm() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    bar = progress_bar(total=3, desc="x", file=Tty())
    assert type(bar).__name__ == "tqdm"
    bar.close()
