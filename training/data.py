"""Click data for DLRM training: a streaming Criteo-format reader and a synthetic click generator.

Both yield :class:`ClickBatch` es (dense float features, 0/1 labels, per-table
jagged ids) and can start at any batch index, which is how a resumed run skips
the batches it already trained on.

Criteo format (one sample per line, tab separated)::

    label \t I1 .. I13 (integers) \t C1 .. C26 (hex tokens)
    1     \t 5 \t \t 3 ...        \t 68fd1e64 \t \t 80e26c9b,a1b2 ...

Choices (documented in the README):

- an empty integer field reads as 0; integers become ``log(1 + max(x, 0))``;
- an empty categorical field is *missing*: with ``missing="reserved"`` (default)
  its bag holds one id, :data:`MISSING_ID` = 2**32 (above every 8-digit Criteo
  token, so it never collides with a real value; the table's hash maps it like
  any raw id); with ``missing="skip"`` its bag is empty and pools to zeros;
- a categorical field may hold several tokens joined by ``multi_hot_delimiter``
  (multi-hot bags); each token is hex (1-16 digits) and becomes a raw int64 id
  (16-digit tokens wrap into the negative range; the table's hash maps them);
- a *malformed* line (wrong field count, label other than 0/1, a non-integer
  dense field, a non-hex or empty token in a non-empty categorical field) is
  skipped and counted, never fatal: real logs have a few broken lines and one
  should not stop a day-long run. The count is logged (warning) at the end of
  each pass and returned by :attr:`CriteoReader.stats`. Blank lines are ignored.

Parsing is vectorised over chunks of lines (numpy string ops, a hex decoder
over the code points), never one Python loop per field; only chunks are in
memory, never the whole file.
"""

from __future__ import annotations

import gzip
import io
import itertools
import logging
import math
import os
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import numpy.typing as npt
import torch

from embstore.errors import InvalidInputError
from embstore.files import not_a_regular_file
from embstore.modmath import INT64_MAX, affine_mod

log = logging.getLogger("embstore.training.data")

MISSING_ID = 1 << 32
NUM_DENSE = 13
NUM_SPARSE = 26
_HEX = np.full(128, -1, dtype=np.int64)
for _i, _c in enumerate("0123456789abcdef"):
    _HEX[ord(_c)] = _i
    _HEX[ord(_c.upper())] = _i


@dataclass(frozen=True)
class ClickBatch:
    """One batch: dense (B, F) float32, labels (B,) float32, per-table ids and offsets (B + 1 entries)."""

    dense: torch.Tensor
    labels: torch.Tensor
    ids: list[torch.Tensor]
    offsets: list[torch.Tensor]

    @property
    def size(self) -> int:
        return len(self.labels)

    def sparse(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return self.ids, self.offsets

    def slice(self, lo: int, hi: int) -> "ClickBatch":
        """Samples [lo, hi) (a rank's share of a global batch)."""
        ids, offs = [], []
        for i, o in zip(self.ids, self.offsets):
            a, b = int(o[lo]), int(o[hi])
            ids.append(i[a:b])
            offs.append(o[lo:hi + 1] - a)
        return ClickBatch(self.dense[lo:hi], self.labels[lo:hi], ids, offs)


@dataclass
class ReaderStats:
    """Lines seen and skipped by one pass of a reader."""

    lines: int = 0
    samples: int = 0
    batches: int = 0  # batches formed, skipped ones included
    malformed: int = 0
    blank: int = 0


# --------------------------------------------------------------------------- Criteo
@dataclass
class _Parsed:
    """Parsed samples not batched yet: dense (n, F), labels (n,), lengths (T, n), ids per table."""

    dense: np.ndarray
    labels: np.ndarray
    lengths: np.ndarray
    ids: list[np.ndarray]

    @property
    def n(self) -> int:
        return len(self.labels)

    @staticmethod
    def concat(a: "_Parsed", b: "_Parsed") -> "_Parsed":
        return _Parsed(np.concatenate([a.dense, b.dense]), np.concatenate([a.labels, b.labels]),
                       np.concatenate([a.lengths, b.lengths], axis=1),
                       [np.concatenate([x, y]) for x, y in zip(a.ids, b.ids)])

    def split(self, k: int) -> tuple["_Parsed", "_Parsed"]:
        cut = self.lengths[:, :k].sum(axis=1)
        head = _Parsed(self.dense[:k], self.labels[:k], self.lengths[:, :k], [x[:c] for x, c in zip(self.ids, cut)])
        tail = _Parsed(self.dense[k:], self.labels[k:], self.lengths[:, k:], [x[c:] for x, c in zip(self.ids, cut)])
        return head, tail

    def to_batch(self) -> ClickBatch:
        offs = np.zeros((self.lengths.shape[0], self.n + 1), dtype=np.int64)
        np.cumsum(self.lengths, axis=1, out=offs[:, 1:])
        return ClickBatch(torch.from_numpy(np.ascontiguousarray(self.dense)), torch.from_numpy(self.labels.copy()),
                          [torch.from_numpy(np.ascontiguousarray(x)) for x in self.ids],
                          [torch.from_numpy(o) for o in offs])


def _hex_to_ids(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int64 ids, ok mask) of a unicode array of hex tokens; empty or >16 digits or non-hex -> not ok."""
    if len(tokens) == 0:
        return np.zeros(0, np.int64), np.zeros(0, bool)
    lens = np.char.str_len(tokens)
    ok = (lens >= 1) & (lens <= 16)
    cps = np.asarray(np.where(ok, tokens, ""), dtype="<U16").view(np.uint32).reshape(len(tokens), 16)
    v = np.zeros(len(tokens), dtype=np.uint64)
    for j in range(16):
        c = cps[:, j]
        pad = c == 0
        d = _HEX[np.minimum(c, 127)]
        ok &= pad | ((c < 128) & (d >= 0))
        v = np.where(pad, v, v * np.uint64(16) + np.maximum(d, 0).astype(np.uint64))
    return v.view(np.int64), ok


def parse_lines(lines: Sequence[str], num_dense: int = NUM_DENSE, num_sparse: int = NUM_SPARSE,
                multi_hot_delimiter: str | None = None, missing: str = "reserved") -> tuple[_Parsed, int, int]:
    """Parse Criteo lines -> (parsed good samples, malformed count, blank count). Vectorised over the lines."""
    nf = 1 + num_dense + num_sparse
    arr = np.char.rstrip(np.asarray(list(lines), dtype=str), "\r\n") if len(lines) else np.zeros(0, "<U1")
    blank = np.char.str_len(arr) == 0
    arr = arr[~blank]
    n_blank = int(blank.sum())
    good_shape = np.char.count(arr, "\t") == nf - 1
    rows = arr[good_shape]
    n = len(rows)
    tok = np.asarray("\t".join(rows.tolist()).split("\t") if n else [], dtype=str).reshape(n, nf)
    ok = (tok[:, 0] == "0") | (tok[:, 0] == "1")
    # dense: empty -> 0; otherwise an optionally negative run of ASCII digits
    d = tok[:, 1:1 + num_dense]
    d = np.where(np.char.str_len(d) == 0, "0", d)
    body = np.char.lstrip(d, "-")
    ok &= (np.char.isdigit(body) & (np.char.str_len(d) - np.char.str_len(body) <= 1)
           & (np.char.str_len(body) <= 18)).all(axis=1)
    dense_i = np.zeros((n, num_dense), dtype=np.int64)
    if ok.any():
        dense_i[ok] = _to_int(d[ok])
    dense = np.log1p(np.maximum(dense_i, 0).astype(np.float64)).astype(np.float32)
    # categorical, table-major: token k = t * n + i
    cat = tok[:, 1 + num_dense:].T.ravel()
    empty = np.char.str_len(cat) == 0
    if missing == "reserved":
        cat = np.where(empty, format(MISSING_ID, "x"), cat)
        empty = np.zeros_like(empty)
    elif missing != "skip":
        raise InvalidInputError(f"missing must be 'reserved' or 'skip', got {missing!r}")
    sep = multi_hot_delimiter or "\t"
    lengths = np.where(empty, 0, np.char.count(cat, sep) + 1 if multi_hot_delimiter else 1).astype(np.int64)
    nonempty = cat[~empty].tolist()
    subs = np.asarray(sep.join(nonempty).split(sep) if nonempty else [], dtype=str)
    ids, id_ok = _hex_to_ids(subs)
    line_of = np.repeat(np.arange(num_sparse * n) % max(n, 1), lengths)
    bad_line = np.zeros(n, dtype=bool)
    bad_line[line_of[~id_ok]] = True
    ok &= ~bad_line
    keep = ok[line_of]
    lengths = lengths.reshape(num_sparse, n)[:, ok]
    kept_ids = ids[keep]
    bounds = np.concatenate([[0], np.cumsum(lengths.sum(axis=1))])
    parsed = _Parsed(dense[ok], (tok[ok, 0] == "1").astype(np.float32), lengths,
                     [kept_ids[bounds[t]:bounds[t + 1]] for t in range(num_sparse)])
    return parsed, int(len(arr) - ok.sum()), n_blank


def _to_int(d: np.ndarray) -> np.ndarray:
    """int64 of already-validated decimal strings (numpy parses; a unicode digit slipping through -> 0 row)."""
    try:
        return d.astype(np.int64)
    except (ValueError, OverflowError):  # non-ASCII digits pass isdigit; rare: fall back per value
        out = np.zeros(d.shape, dtype=np.int64)
        for idx, s in np.ndenumerate(d):
            try:
                out[idx] = int(s)
            except ValueError:
                out[idx] = 0
        return out


def _open_text(path: Path) -> io.TextIOBase:
    if path.suffix == ".gz":
        return io.TextIOWrapper(gzip.open(path, "rb"), encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


@dataclass
class CriteoReader:
    """Stream batches out of Criteo-format TSV files (optionally gzipped), chunk by chunk.

    ``holdout_every`` N > 0 splits deterministically by line number: line i
    (0-based, over all files) is held out when ``i % N == N - 1``;
    ``split="train"`` reads the other lines, ``"holdout"`` those, ``"all"`` every line.
    """

    paths: Sequence[str | os.PathLike]
    batch_size: int
    num_dense: int = NUM_DENSE
    num_sparse: int = NUM_SPARSE
    multi_hot_delimiter: str | None = None
    missing: str = "reserved"
    split: str = "all"
    holdout_every: int = 0
    drop_last: bool = False
    chunk_lines: int = 65536
    stats: ReaderStats = field(default_factory=ReaderStats)

    def __post_init__(self) -> None:
        if isinstance(self.paths, (str, os.PathLike)):
            self.paths = [self.paths]
        self.paths = [Path(p) for p in self.paths]
        for p in self.paths:
            kind = not_a_regular_file(p)  # a FIFO blocks its open until a writer comes, and epochs reread it
            if kind is not None:
                raise InvalidInputError(f"Criteo data file {str(p)!r} is {kind}, not a regular file")
            if not p.is_file():
                raise FileNotFoundError(f"Criteo data file {str(p)!r} does not exist")
        if self.batch_size < 1:
            raise InvalidInputError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.split not in ("all", "train", "holdout"):
            raise InvalidInputError(f"split must be 'all', 'train' or 'holdout', got {self.split!r}")
        if self.split != "all" and self.holdout_every < 2:
            raise InvalidInputError(f"split={self.split!r} needs holdout_every >= 2, got {self.holdout_every}")
        if self.missing not in ("reserved", "skip"):
            raise InvalidInputError(f"missing must be 'reserved' or 'skip', got {self.missing!r}")
        if self.multi_hot_delimiter in ("\t", "\n", ""):
            raise InvalidInputError("multi_hot_delimiter must not be a tab, newline or empty")

    def _chunks(self) -> Iterator[list[str]]:
        """Chunks of raw lines of the chosen split; line numbers run over all files."""
        for path in self.paths:
            with _open_text(path) as f:
                while True:
                    try:
                        lines = list(itertools.islice(f, self.chunk_lines))
                    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:  # not a line to skip: the rest is lost
                        raise InvalidInputError(f"Criteo data file {str(path)!r} is a truncated or corrupt gzip "
                                                f"file ({exc})") from None
                    if not lines:
                        break
                    first = self.stats.lines
                    self.stats.lines += len(lines)
                    if self.split != "all":
                        n = self.holdout_every
                        j0 = (n - 1 - first) % n
                        if self.split == "holdout":
                            lines = lines[j0::n]
                        else:
                            del lines[j0::n]
                    yield lines

    def __iter__(self) -> Iterator[ClickBatch]:
        return self.iter_batches()

    def iter_batches(self, start: int = 0) -> Iterator[ClickBatch]:
        """Batches from the beginning, the first ``start`` of them parsed but not yielded (resume)."""
        self.stats = ReaderStats()
        pending: _Parsed | None = None
        index = 0
        for lines in self._chunks():
            parsed, bad, blank = parse_lines(lines, self.num_dense, self.num_sparse, self.multi_hot_delimiter,
                                             self.missing)
            self.stats.malformed += bad
            self.stats.blank += blank
            pending = parsed if pending is None else _Parsed.concat(pending, parsed)
            while pending.n >= self.batch_size:
                head, pending = pending.split(self.batch_size)
                index += 1
                self.stats.batches = index
                if index > start:
                    self.stats.samples += head.n
                    yield head.to_batch()
        if pending is not None and pending.n and not self.drop_last:
            index += 1
            self.stats.batches = index
            if index > start:
                self.stats.samples += pending.n
                yield pending.to_batch()
        if self.stats.malformed:
            log.warning("criteo reader: skipped %d malformed line(s) of %d in %s", self.stats.malformed,
                        self.stats.lines, ", ".join(str(p) for p in self.paths))


# --------------------------------------------------------------------------- synthetic
_MULTS = (2654435761, 2147483647, 4294967291)  # primes: rank -> id scramble multipliers, see _multiplier


def _splitmix(x: np.ndarray) -> np.ndarray:
    """A 64-bit mixer (splitmix64 finaliser) on uint64 arrays: counter-based randomness per id."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _multiplier(n: int) -> int:
    """The first of :data:`_MULTS` that does not divide ``n``: a unit mod n, since each is prime and all three
    dividing n would need n >= their product (> 2**94). 2654435761 for every n it does not divide (as always)."""
    return next(p for p in _MULTS if n % p)


def _synthetic_ids(ranks: np.ndarray, n: int, table: int) -> npt.NDArray[np.int64]:
    """Ranks in [0, n) -> ids ``(rank * mult + table * 977) mod n``: a bijection of [0, n) for any n up to
    2**63 - 1, computed exactly (the 64-bit product used to wrap above ~2**64 / mult ids)."""
    return affine_mod(_multiplier(n), ranks, table * 977 % n, n)


def zipf_ranks(rng: np.random.Generator, n: int, alpha: float, size: int) -> np.ndarray:
    """Ranks in [0, n) with P(rank k) ~ (k + 1)^-alpha (continuous inverse CDF; any alpha >= 0, O(1) memory)."""
    u = rng.random(size)
    if abs(alpha - 1.0) < 1e-9:
        x = np.exp(u * math.log(n + 1.0))
    else:
        e = 1.0 - alpha
        x = ((np.power(n + 1.0, e) - 1.0) * u + 1.0) ** (1.0 / e)
    return np.minimum(np.floor(x).astype(np.int64) - 1, n - 1).clip(0)


@dataclass(frozen=True)
class SyntheticClicks:
    """Clicks with a planted signal a DLRM can learn.

    Per table t, ids are Zipf(``zipf_alpha``) ranks scrambled over ``id_space[t]``
    (larger alpha = more reuse of hot ids); each bag holds ``bag_min..bag_max``
    ids (multi-hot). Every (table, id) has a hidden weight w ~ uniform with std
    1, a pure function of (seed, table, id). The label is
    ``Bernoulli(sigmoid(signal * sum_{t < signal_tables} mean_bag(w) + dense @ beta + bias))``.
    ``shuffle_labels`` permutes labels within each batch: the control that no
    model should beat (AUC ~ 0.5). Batch i of a split is a pure function of
    (seed, split, i), so any batch can be made without the ones before it.
    """

    id_space: tuple[int, ...]
    batch_size: int
    num_batches: int
    num_dense: int = NUM_DENSE
    zipf_alpha: float = 1.05
    bag_min: int = 1
    bag_max: int = 1
    signal_tables: int = 2
    signal: float = 2.0
    dense_signal: float = 0.5
    bias: float = -0.5
    shuffle_labels: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "id_space", tuple(int(x) for x in self.id_space))
        if not self.id_space or min(self.id_space) < 1:
            raise InvalidInputError(f"id_space must list one positive size per table, got {self.id_space}")
        if max(self.id_space) > INT64_MAX:
            raise InvalidInputError(f"id_space sizes must be at most 2**63 - 1 (ids are int64), got "
                                    f"{max(self.id_space)}")
        if self.batch_size < 1 or self.num_batches < 1:
            raise InvalidInputError("batch_size and num_batches must be >= 1")
        if not 0 <= self.bag_min <= self.bag_max or self.bag_max < 1:
            raise InvalidInputError(f"need 0 <= bag_min <= bag_max, bag_max >= 1; got {self.bag_min}, {self.bag_max}")
        if not 0 <= self.signal_tables <= len(self.id_space):
            raise InvalidInputError(f"signal_tables must be in [0, {len(self.id_space)}], got {self.signal_tables}")
        if self.zipf_alpha < 0:
            raise InvalidInputError(f"zipf_alpha must be >= 0, got {self.zipf_alpha}")

    def hidden_weight(self, table: int, ids: np.ndarray) -> np.ndarray:
        """The planted per-id weight (std 1), a pure function of (seed, table, id)."""
        # mod 2**64: the same salt as ever for the seeds that fit, and a seed above ~2**44 no OverflowError
        salt = _splitmix(np.array([(self.seed * 1_000_003 + table) % (1 << 64)], dtype=np.uint64))[0]
        u = (_splitmix(ids.astype(np.uint64) ^ salt) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        return (u * 2.0 - 1.0) * math.sqrt(3.0)

    def batch(self, index: int, split: str = "train") -> ClickBatch:
        tag = {"train": 0, "holdout": 1}[split]
        rng = np.random.default_rng([self.seed, tag, int(index)])
        b = self.batch_size
        dense = np.log1p(rng.exponential(3.0, (b, self.num_dense))).astype(np.float32)
        beta = np.random.default_rng([self.seed, 99]).standard_normal(self.num_dense) / math.sqrt(self.num_dense)
        logit = self.bias + self.dense_signal * ((dense - 1.4) @ beta)
        ids, offs = [], []
        for t, n in enumerate(self.id_space):
            lens = rng.integers(self.bag_min, self.bag_max + 1, b)
            total = int(lens.sum())
            x = _synthetic_ids(zipf_ranks(rng, n, self.zipf_alpha, total), n, t)
            o = np.zeros(b + 1, dtype=np.int64)
            np.cumsum(lens, out=o[1:])
            if t < self.signal_tables:
                w = self.hidden_weight(t, x)
                sums = np.add.reduceat(np.concatenate([w, [0.0]]), o[:-1]) if total else np.zeros(b)
                sums = np.where(lens > 0, sums, 0.0)
                logit = logit + self.signal * sums / np.maximum(lens, 1) / math.sqrt(max(self.signal_tables, 1))
            ids.append(torch.from_numpy(x))
            offs.append(torch.from_numpy(o))
        labels = (rng.random(b) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        if self.shuffle_labels:
            labels = labels[rng.permutation(b)]
        return ClickBatch(torch.from_numpy(dense), torch.from_numpy(labels), ids, offs)

    def iter_batches(self, start: int = 0, split: str = "train", count: int | None = None) -> Iterator[ClickBatch]:
        """Batches ``start .. count`` (default ``num_batches``) of a split; skipping costs nothing."""
        end = self.num_batches if count is None else count
        for i in range(start, end):
            yield self.batch(i, split)

    def __iter__(self) -> Iterator[ClickBatch]:
        return self.iter_batches()


__all__ = ["ClickBatch", "CriteoReader", "MISSING_ID", "NUM_DENSE", "NUM_SPARSE", "ReaderStats", "SyntheticClicks",
           "parse_lines", "zipf_ranks"]
