"""Progress on long work: a tqdm bar on a terminal, plain log lines everywhere else.

A bar redrawn with carriage returns turns a CI log or ``nohup`` output into one
enormous line; off a terminal the same calls print a line every ``interval``
seconds and one at the end instead (``desc: 1,200/6,000 step (20%), 41.2
step/s, loss=0.59``).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

__all__ = ["LineProgress", "progress_bar"]


class LineProgress:
    """The part of tqdm's interface embstore uses, printing whole lines."""

    def __init__(self, total: int | None = None, desc: str = "", unit: str = "it", initial: int = 0,
                 file: TextIO | None = None, interval: float = 30.0, leave: bool = True) -> None:
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self.leave = leave  # False: a transient bar, so no closing line
        self.file = file or sys.stderr
        self.interval = interval
        self._start = self._last = time.monotonic()
        self._start_n = initial
        self._postfix = ""
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            self._emit(now)

    def set_postfix(self, **kwargs: Any) -> None:
        self._postfix = ", ".join(f"{k}={v}" for k, v in kwargs.items())

    def write(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.leave:
                self._emit(time.monotonic(), done=True)

    def _emit(self, now: float, done: bool = False) -> None:
        elapsed = now - self._start
        rate = (self.n - self._start_n) / elapsed if elapsed > 0 else 0.0
        count = f"{self.n:,}/{self.total:,} {self.unit} ({100 * self.n / self.total:.0f}%)" \
            if self.total else f"{self.n:,} {self.unit}"
        parts = [count, f"{rate:,.1f} {self.unit}/s"] + ([self._postfix] if self._postfix else [])
        suffix = f" in {elapsed:.1f}s" if done else ""
        self.write(f"{self.desc + ': ' if self.desc else ''}{', '.join(parts)}{suffix}")

    def __enter__(self) -> "LineProgress":
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:  # the work failed: its error says so, not a closing count
            self._closed = True
        self.close()


def progress_bar(total: int | None = None, desc: str = "", unit: str = "it", *, initial: int = 0,
                 leave: bool = True, unit_scale: bool = False, file: TextIO | None = None,
                 interval: float = 30.0, enabled: bool = True) -> Any:
    """tqdm when ``file`` (default stderr) is a terminal, else a :class:`LineProgress`; with
    ``enabled=False`` one that prints nothing."""
    out = file or sys.stderr
    if not enabled:
        return LineProgress(total, desc, unit, initial, out, float("inf"), leave=False)
    if getattr(out, "isatty", lambda: False)():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, initial=initial, leave=leave, unit_scale=unit_scale,
                    dynamic_ncols=True, file=out)
    return LineProgress(total, desc, unit, initial, out, interval, leave)
