"""Faults of the write-ahead log's ``fdatasync`` (an EIO cannot be aimed at one log sync for real), and
threads to race a store's calls against each other with events rather than timing."""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable


class LosingSync:
    """``os.fdatasync`` that fails once, after putting back zeros where the bytes written since the
    file's last good sync were (what a failed writeback leaves once the kernel drops the pages it marked
    clean); every other call is real. The tiers bind their own sync at import: only the log's calls count."""

    def __init__(self, fail_at: int) -> None:
        self.calls, self.fail_at = 0, fail_at
        self.synced: dict[str, int] = {}
        self.real = os.fdatasync

    def _lose(self, fd: int) -> None:
        """Zero the bytes of ``fd``'s file written since its last good sync."""
        path = os.readlink(f"/proc/self/fd/{fd}")
        good, size = self.synced.get(path, 0), os.fstat(fd).st_size
        with open(path, "r+b") as f:
            f.seek(good)
            f.write(b"\0" * (size - good))

    def __call__(self, fd: int) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            self._lose(fd)
            raise OSError(errno.EIO, "Input/output error")
        self.real(fd)
        self.synced[os.readlink(f"/proc/self/fd/{fd}")] = os.fstat(fd).st_size


class HeldLosingSync(LosingSync):
    """:class:`LosingSync` whose failing call loses the pages at once, then holds its EIO until
    ``release`` is set: the window in which another sync of the same open file description would
    "succeed" without them (Linux reports a write-back error once per description)."""

    def __init__(self, fail_at: int) -> None:
        super().__init__(fail_at)
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, fd: int) -> None:
        if self.calls + 1 != self.fail_at:
            return super().__call__(fd)
        self.calls += 1
        self._lose(fd)
        self.entered.set()
        self.release.wait(30)
        raise OSError(errno.EIO, "Input/output error")


def in_thread(fn: Callable[[], object], name: str | None = None) -> tuple[threading.Thread, list[BaseException | None]]:
    """Start ``fn`` in a thread (named ``name``); the list gets what it raised (None if nothing) when it ends."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as exc:  # noqa: BLE001 - inspected by the caller
            out.append(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread, out


def until(predicate: Callable[[], bool], what: str, timeout: float = 30) -> None:
    """Wait for ``predicate()`` to hold (polling: the outcome never depends on how long it takes);
    fail with ``what`` if it has not after ``timeout`` seconds, rather than hang."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


class WatchedLock:
    """A stand-in for a store's ``threading.Lock`` that tells which threads (by name) wait for it, so that
    a test can start the next step once a thread is queued on it."""

    def __init__(self, lock: threading.Lock | None = None) -> None:
        self._lock = lock if lock is not None else threading.Lock()
        self.waiting: set[str] = set()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(False):
            return True
        if not blocking:
            return False
        me = threading.current_thread().name
        self.waiting.add(me)
        try:
            return self._lock.acquire(True, timeout)
        finally:
            self.waiting.discard(me)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def queued_or_done(lock: WatchedLock, thread: threading.Thread) -> bool:
    """``thread`` waits for ``lock`` or has ended: the step it runs has been let through or held."""
    return thread.name in lock.waiting or not thread.is_alive()
