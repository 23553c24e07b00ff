"""Real faults for tier tests: a tiny tmpfs (ENOSPC), an ext4 on a shrinking loop device (EIO), SIGKILL.

Both need root and ``mount``; where that is impossible the tests that use
them are skipped with the reason (``needs_mount``), never passed silently.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from crash_states import whole_lines


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def _mount_unavailable() -> str | None:
    """Why real-fault tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root to mount a tmpfs"
    probe = tempfile.mkdtemp(prefix="embstore_probe_")
    try:
        res = _run("mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", probe)
        if res.returncode != 0:
            return f"mount -t tmpfs failed: {res.stderr.strip()}"
        _run("umount", probe)
        return None
    finally:
        os.rmdir(probe)


_NO_MOUNT = _mount_unavailable()
needs_mount = pytest.mark.skipif(_NO_MOUNT is not None, reason=f"real fault injection impossible: {_NO_MOUNT}")


class Tmpfs:
    def __init__(self, path: Path, size: int) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)
        res = _run("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path))
        assert res.returncode == 0, res.stderr

    def resize(self, size: int) -> None:
        res = _run("mount", "-o", f"remount,size={size}", str(self.path))
        assert res.returncode == 0, res.stderr

    def unmount(self) -> None:
        if _run("umount", str(self.path)).returncode != 0:
            _run("umount", "-l", str(self.path))


def tiny_tmpfs_fixture(tmp_path: Path):
    """A 4 MiB tmpfs: writes beyond it fail with a real ENOSPC."""
    fs = Tmpfs(tmp_path / "tmpfs", 4 << 20)
    yield fs
    fs.unmount()


class FailingExt4:
    """ext4 on a loop device that can be made to fail with a real EIO.

    ``start_failing`` syncs, saves the image beyond ``keep`` bytes and shrinks the
    loop device to ``keep``: ext4 still believes in the blocks past the end, and
    every write there fails with EIO ("access beyond end of device"), after which
    ext4 aborts its journal. ``repair`` puts the tail back, unmounts, runs e2fsck
    and mounts again, like replacing a failed disk with an image of it.
    """

    SIZE = 64 << 20

    def __init__(self, root: Path) -> None:
        self.backing = Tmpfs(root / "backing", 2 * self.SIZE)
        self.image = self.backing.path / "disk.img"
        self.path = root / "ext4"
        self.path.mkdir()
        self.loop = ""
        self.keep = 0
        self.tail = b""
        with open(self.image, "wb") as f:
            f.truncate(self.SIZE)
        res = _run("mkfs.ext4", "-q", "-F", str(self.image))
        assert res.returncode == 0, res.stderr
        res = _run("losetup", "-f", "--show", str(self.image))
        assert res.returncode == 0, res.stderr
        self.loop = res.stdout.strip()
        self._mount()

    def _mount(self) -> None:
        res = _run("mount", "-t", "ext4", self.loop, str(self.path))
        assert res.returncode == 0, res.stderr

    def start_failing(self, keep: int = 8 << 20) -> None:
        os.sync()
        with open(self.image, "r+b") as f:
            f.seek(keep)
            self.tail, self.keep = f.read(), keep
            f.truncate(keep)
        res = _run("losetup", "-c", self.loop)
        assert res.returncode == 0, res.stderr

    def repair(self) -> None:
        assert _run("umount", str(self.path)).returncode == 0
        with open(self.image, "r+b") as f:
            f.seek(self.keep)
            f.write(self.tail)
        assert _run("losetup", "-c", self.loop).returncode == 0
        res = _run("e2fsck", "-f", "-y", self.loop)
        assert res.returncode in (0, 1), res.stdout + res.stderr  # 1: errors corrected
        self._mount()

    def destroy(self) -> None:
        if _run("umount", str(self.path)).returncode != 0:
            _run("umount", "-l", str(self.path))
        if self.loop:
            _run("losetup", "-d", self.loop)
        self.backing.unmount()


def _eio_unavailable() -> str | None:
    if _NO_MOUNT:
        return _NO_MOUNT
    missing = [t for t in ("mkfs.ext4", "losetup", "e2fsck") if shutil.which(t) is None]
    if missing:
        return f"missing tools: {', '.join(missing)}"
    if not any(Path("/dev").glob("loop*")):
        return "no loop devices"
    return None


def failing_ext4_fixture(tmp_path: Path):
    reason = _eio_unavailable()
    if reason:
        pytest.skip(f"real EIO injection impossible: {reason}")
    try:
        fs = FailingExt4(tmp_path)
    except AssertionError as exc:
        pytest.skip(f"real EIO injection impossible: loop-mounted ext4 failed: {exc}")
    yield fs
    fs.destroy()


def kill_at_random_point(args: list[str], rnd: random.Random, first_round: int, last_round: int,
                         max_delay: float) -> tuple[int, int]:
    """Run a writer (``python -c *args`` printing "start N" / "flushed N"), SIGKILL it up to ``max_delay``
    seconds into a random round in [first_round, last_round]; returns (last flushed, last started)."""
    child = subprocess.Popen([sys.executable, "-c", *args], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    target, lines = f"start {rnd.randint(first_round, last_round)}", []
    try:
        for line in child.stdout:
            lines.append(line)
            if line.strip() == target:
                break
        time.sleep(rnd.uniform(0, max_delay))
    finally:
        child.send_signal(signal.SIGKILL)
        out, err = child.stdout.read(), child.stderr.read()  # not communicate(): it would skip
        child.wait()                                         # lines already buffered in stdout
    assert child.returncode == -signal.SIGKILL, err
    # only whole lines: the kill may land in the middle of a print ("flushed 1" of "flushed 19")
    events = [line.split() for line in lines + whole_lines(out)]
    flushed = [int(r) for what, r in events if what == "flushed"]
    started = [int(r) for what, r in events if what == "start"]
    assert started == list(range(len(started))), "the writer failed before the kill: " + err
    return (flushed[-1] if flushed else -1), (started[-1] if started else -1)
