"""The I/O engine of the ssd tiers: moves lists of (file offset, memory address, length) between a
file and memory with io_uring, or with pread/pwrite where io_uring is unavailable.

Why this I/O engine (pyuring 0.3.0 studied, see ``pyuring/native/uring_ctx.py``):

- ``UringCtx.read_async``/``wait_completion`` cost a Python call (and a ctypes
  round trip) per operation; a Python loop over them reached ~27% of fio.
- ``uring_read_offsets_sync`` (a C helper in pyuring's ``liburingwrap.so``)
  submits a whole batch of fixed-size reads in one call, but it drains the
  queue to zero before the next batch (and leaves CQEs behind on an error);
  measured ~85% of fio at depth 64 on this VM.
- Chosen: a numba ``@njit(cache=True, nogil=True)`` loop that calls pyuring's
  shipped library directly (without the GIL, so a look-ahead thread waiting on
  the disk does not stall the training thread). ``io_uring_get_sqe``/
  ``io_uring_submit`` (liburing, exported by ``liburingwrap.so``) and pyuring's
  own ``uring_wait_completion``/
  ``uring_peek_completion`` are bound by address with ``llvmlite.binding.add_symbol``
  and declared as numba ``ExternalFunction`` s, so the compiled loop (and its
  on-disk cache) links to them by name. The loop fills each 64-byte SQE itself
  (the kernel UAPI layout of ``IORING_OP_READ``/``WRITE``), keeps ``queue_depth``
  requests in flight at all times (refill as completions arrive, like fio) and
  submits everything queued with one ``io_uring_enter``. No Python runs per
  operation; get() of 4096 random 256-byte rows reaches 0.85-0.96 of fio's
  4 KiB randread IOPS at the same depth on this VM (``tools/bench/bench_ssd.py``:
  0.87 at depth 64 on a 4 GiB slab, 0.91 at 16, 0.96 at 128), with ~0.6 ms of
  numpy work per 4096-id batch. Registered buffers/files, COOP_TASKRUN and
  SINGLE_ISSUER|DEFER_TASKRUN rings, and one submit_and_wait per refill were
  tried and made no difference beyond noise, so the ring is a plain one (any
  thread may use it, under the tier's lock) with plain READ/WRITE.
- Adjacent blocks are merged into one request (a "run", up to 1 MiB), so bulk
  loads and scans issue large I/Os while random gets issue one 4 KiB read each.
- Fallback: where io_uring cannot be set up (kernel, seccomp, missing library)
  or ``EMBSTORE_NO_IO_URING=1`` / ``use_io_uring=False``, the same numba loop
  shape calls libc ``pread``/``pwrite`` (one at a time). Where the file system
  refuses O_DIRECT the slab is opened buffered. Each fallback is logged once.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import logging
import os
import threading
from typing import Any

import numpy as np
from numba import carray, njit, types
from numba.extending import intrinsic

log = logging.getLogger(__name__)

_IORING_OP_READ = 22
_IORING_OP_WRITE = 23
_EINTR, _EAGAIN, _EBUSY = _errno.EINTR, _errno.EAGAIN, _errno.EBUSY
_SPIN_LIMIT = 1_000_000  # consecutive EAGAIN/EBUSY from io_uring_enter before giving up


# ---------------------------------------------------------------------------
# native symbols: resolved by name at link time of the numba code (cacheable)
# ---------------------------------------------------------------------------
_u64, _i32, _i64 = types.uint64, types.int32, types.int64
_c_get_sqe = types.ExternalFunction("embstore_ssd_io_uring_get_sqe", _u64(_u64))
_c_submit = types.ExternalFunction("embstore_ssd_io_uring_submit", _i32(_u64))
_c_wait = types.ExternalFunction("embstore_ssd_uring_wait_completion", _i32(_u64, _u64, _u64))
_c_peek = types.ExternalFunction("embstore_ssd_uring_peek_completion", _i32(_u64, _u64, _u64))
_c_pread = types.ExternalFunction("embstore_ssd_pread", _i64(_i32, _u64, _u64, _i64))
_c_pwrite = types.ExternalFunction("embstore_ssd_pwrite", _i64(_i32, _u64, _u64, _i64))
_c_errno_loc = types.ExternalFunction("embstore_ssd_errno_location", _u64())

_symbols_lock = threading.Lock()
_symbols: dict[str, bool] = {}
_logged: set[str] = set()


def log_once(logger: logging.Logger, key: str, message: str, *args: Any) -> None:
    """A warning logged once per process: a fallback is news the first time, noise after."""
    if key not in _logged:
        _logged.add(key)
        logger.warning(message, *args)


def _register(names: dict[str, Any]) -> None:
    import llvmlite.binding as llb

    for name, fn in names.items():
        llb.add_symbol(name, ctypes.cast(fn, ctypes.c_void_p).value)


def _bind_libc() -> None:
    with _symbols_lock:
        if "libc" not in _symbols:
            libc = ctypes.CDLL(None, use_errno=True)
            _register({"embstore_ssd_pread": libc.pread, "embstore_ssd_pwrite": libc.pwrite,
                       "embstore_ssd_errno_location": libc.__errno_location})
            _symbols["libc"] = True


def _bind_uring(lib: ctypes.CDLL) -> None:
    with _symbols_lock:
        if "uring" not in _symbols:
            _register({"embstore_ssd_io_uring_get_sqe": lib.io_uring_get_sqe,
                       "embstore_ssd_io_uring_submit": lib.io_uring_submit,
                       "embstore_ssd_uring_wait_completion": lib.uring_wait_completion,
                       "embstore_ssd_uring_peek_completion": lib.uring_peek_completion})
            _symbols["uring"] = True


@intrinsic
def _as_u64_ptr(typingctx, addr):  # type: ignore[no-untyped-def]
    sig = types.CPointer(types.uint64)(types.uint64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


@intrinsic
def _as_i32_ptr(typingctx, addr):  # type: ignore[no-untyped-def]
    sig = types.CPointer(types.int32)(types.uint64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return sig, codegen


# ---------------------------------------------------------------------------
# I/O kernels: one call moves a whole list of (file offset, memory address, length)
# ---------------------------------------------------------------------------
@njit(cache=True, nogil=True)
def _uring_kernel(ring: int, fd: int, opcode: int, offs: np.ndarray, addrs: np.ndarray, lens: np.ndarray,
                  qd: int, res: np.ndarray) -> int:
    """Run every request through the ring with ``qd`` in flight; res[i] = cqe result of request i.

    Returns 0, or the negative errno of a ring failure (submit/wait); in that case
    every request the kernel took has completed before returning.
    """
    n = offs.shape[0]
    ud = np.zeros(1, np.uint64)
    rr = np.zeros(1, np.int32)
    udp = np.uint64(ud.ctypes.data)
    rrp = np.uint64(rr.ctypes.data)
    word0 = np.uint64(opcode) | (np.uint64(fd) << np.uint64(32))
    nxt = 0
    inflight = 0  # queued in the SQ ring or owned by the kernel
    pending = 0  # queued but not yet taken by the kernel
    done = 0
    fatal = 0
    spins = 0
    while done < n:
        while nxt < n and inflight < qd:
            a = _c_get_sqe(ring)
            if a == 0:
                break
            s = carray(_as_u64_ptr(a), 8)
            s[0] = word0  # opcode, flags=0, ioprio=0, fd
            s[1] = np.uint64(offs[nxt])
            s[2] = addrs[nxt]
            s[3] = np.uint64(lens[nxt])  # len, rw_flags=0
            s[4] = np.uint64(nxt)  # user_data
            s[5] = 0
            s[6] = 0
            s[7] = 0
            nxt += 1
            inflight += 1
            pending += 1
        if pending > 0:
            r = _c_submit(ring)
            if r >= 0:
                pending = pending - r if r < pending else 0
            elif r == -_EINTR or r == -_EAGAIN or r == -_EBUSY:
                spins += 1
                if spins > _SPIN_LIMIT and inflight == pending:
                    fatal = r
                    break
            else:
                fatal = r
                break
        if inflight > pending:
            r = _c_wait(ring, udp, rrp)
            if r < 0:
                if r == -_EINTR or r == -_EAGAIN:
                    continue
                fatal = r
                break
            spins = 0
            res[ud[0]] = rr[0]
            inflight -= 1
            done += 1
            while inflight > pending:
                if _c_peek(ring, udp, rrp) != 1:
                    break
                res[ud[0]] = rr[0]
                inflight -= 1
                done += 1
    if fatal != 0:
        # the kernel may still DMA into the caller's buffers: wait those out
        tries = 0
        while inflight > pending and tries < _SPIN_LIMIT:
            r = _c_wait(ring, udp, rrp)
            if r == 0:
                res[ud[0]] = rr[0]
                inflight -= 1
            elif r == -_EINTR or r == -_EAGAIN:
                tries += 1
            else:
                break
    return fatal


@njit(cache=True, nogil=True)
def _pio_kernel(fd: int, write: bool, offs: np.ndarray, addrs: np.ndarray, lens: np.ndarray,
                res: np.ndarray) -> int:
    """pread/pwrite fallback with the same contract as :func:`_uring_kernel`; stops at the first error."""
    errp = carray(_as_i32_ptr(_c_errno_loc()), 1)
    for i in range(offs.shape[0]):
        want = np.int64(lens[i])
        got = np.int64(0)
        while got < want:
            if write:
                r = _c_pwrite(fd, addrs[i] + np.uint64(got), np.uint64(want - got), offs[i] + got)
            else:
                r = _c_pread(fd, addrs[i] + np.uint64(got), np.uint64(want - got), offs[i] + got)
            if r < 0:
                e = errp[0]
                if e == _EINTR:
                    continue
                res[i] = -e
                return 0
            if r == 0:
                break
            got += r
        res[i] = got
    return 0


class Engine:
    """Moves lists of block runs between the slab and memory; raises OSError(errno) on any failure."""

    def __init__(self, fd: int, queue_depth: int, use_io_uring: bool) -> None:
        self.fd = fd
        self.queue_depth = queue_depth
        self._ctx: Any = None
        self._pid = os.getpid()
        self.io_uring = False
        if use_io_uring:
            try:
                self._open_ring()
                self.io_uring = True
            except Exception as exc:  # no io_uring: kernel, seccomp, library
                log_once(log, "no-io_uring", "ssd tier: io_uring unavailable (%s); using pread/pwrite", exc)
        if not self.io_uring:
            _bind_libc()

    def _open_ring(self) -> None:
        from pyuring import UringCtx

        ctx = UringCtx(entries=self.queue_depth, single_thread_check=False)
        try:
            for op in (_IORING_OP_READ, _IORING_OP_WRITE):  # kernels before 5.6 lack them
                if not ctx.probe_opcode_supported(op):
                    raise OSError(_errno.EOPNOTSUPP, f"io_uring opcode {op} not supported by this kernel")
            _bind_uring(ctx._lib)
        except BaseException:
            ctx.close()
            raise
        self._ctx = ctx
        self._ring = int(ctx._ctx)
        self._pid = os.getpid()

    def _reset_ring(self) -> None:
        """Replace a ring that failed as a whole (its queues may hold stale entries)."""
        old, self._ctx = self._ctx, None
        if old is not None and self._pid == os.getpid():
            old.close()
        self._open_ring()

    def run(self, write: bool, offs: np.ndarray, addrs: np.ndarray, lens: np.ndarray) -> None:
        n = len(offs)
        if n == 0:
            return
        for attempt in range(_SHORT_RETRIES + 1):  # a short transfer is resumed where it stopped
            res = self._submit(write, offs, addrs, lens)
            if (res < 0).any():
                self.check(res, lens, write)  # raises the first hard error (ENOSPC often comes here)
            partial = np.flatnonzero(res < lens)
            if len(partial) == 0:
                return
            if attempt == _SHORT_RETRIES or (res[partial] == 0).any():
                self.check(res, lens, write)  # no progress: a short transfer error
            done = res[partial]
            offs = offs[partial] + done.astype(offs.dtype)
            addrs = addrs[partial] + done.astype(addrs.dtype)
            lens = lens[partial] - done.astype(lens.dtype)

    def _submit(self, write: bool, offs: np.ndarray, addrs: np.ndarray, lens: np.ndarray) -> np.ndarray:
        n = len(offs)
        res = np.zeros(n, dtype=np.int32)
        if self.io_uring:
            if self._ctx is None or self._pid != os.getpid():  # a forked child must not share the ring
                self._ctx = None
                self._open_ring()
            op = _IORING_OP_WRITE if write else _IORING_OP_READ
            fatal = _uring_kernel(self._ring, self.fd, op, offs, addrs, lens, self.queue_depth, res)
            if fatal < 0:
                try:
                    self._reset_ring()
                except Exception:  # pragma: no cover - the next call retries
                    self._ctx = None
                raise OSError(-fatal, f"io_uring: {os.strerror(-fatal)}")
        else:
            _pio_kernel(self.fd, write, offs, addrs, lens, res)
        return res

    @staticmethod
    def check(res: np.ndarray, lens: np.ndarray, write: bool) -> None:
        what = "write" if write else "read"
        bad = np.flatnonzero(res < 0)
        if len(bad):
            e = -int(res[bad[0]])
            raise OSError(e, f"{what} of {int(lens[bad[0]])} bytes failed: {os.strerror(e)}")
        short = np.flatnonzero(res != lens)
        if len(short):
            i = int(short[0])
            raise OSError(_errno.EIO, f"short {what}: {int(res[i])} of {int(lens[i])} bytes")

    def close(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is not None and self._pid == os.getpid():
            ctx.close()


_SHORT_RETRIES = 8
