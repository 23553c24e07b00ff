"""Sparse batch inputs: per-table (ids, offsets) lists, or a keyed jagged batch.

``offsets`` follow SPEC section 1: ``num_bags + 1`` entries, ``offsets[0] == 0``
and ``offsets[-1] == len(ids)`` (torch's ``include_last_offset=True`` form).
The ``num_bags``-entry form of ``torch.nn.functional.embedding_bag`` is not
accepted: a one-entry offsets array would be ambiguous between the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from embstore.arrays import as_ids, as_offsets
from embstore.errors import InvalidInputError


@dataclass(frozen=True)
class KeyedJaggedBatch:
    """TorchRec ``KeyedJaggedTensor`` layout without the dependency.

    ``values``: every key's ids back to back (key-major); ``lengths``:
    ``len(keys) * batch_size`` bag lengths, key-major (key k's bags are
    ``lengths[k*B:(k+1)*B]``).
    """

    keys: Sequence[str]
    values: torch.Tensor
    lengths: torch.Tensor

    def split(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """key -> (ids, offsets with num_bags + 1 entries), validated."""
        if isinstance(self.keys, str) or not isinstance(self.keys, Sequence) \
                or not all(isinstance(k, str) for k in self.keys):
            raise InvalidInputError(f"keys must be a list of table names, got {self.keys!r}")
        vals, _ = as_ids(self.values, "values")
        lens, _ = as_ids(self.lengths, "lengths")
        nk = len(self.keys)
        if len(set(self.keys)) != nk:
            raise InvalidInputError(f"keys must be distinct, got {list(self.keys)}")
        if nk == 0 or len(lens) % nk:
            raise InvalidInputError(f"lengths has {len(lens)} entries, not a multiple of {nk} keys")
        if len(lens) and lens.min() < 0:
            raise InvalidInputError("lengths must be >= 0")
        if int(lens.sum()) != len(vals):
            raise InvalidInputError(f"lengths sum to {int(lens.sum())} but values has {len(vals)} entries")
        b = len(lens) // nk
        ends = np.concatenate([[0], np.cumsum(lens)])
        out = {}
        for k, key in enumerate(self.keys):
            lo, hi = ends[k * b], ends[(k + 1) * b]
            out[key] = (vals[lo:hi], ends[k * b:(k + 1) * b + 1] - lo)
        return out


def normalize(tables: Sequence[str], ids: Any, offsets: Any = None) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-table validated (ids, offsets) numpy lists from either input form; same batch size for all."""
    if isinstance(ids, KeyedJaggedBatch):
        if offsets is not None:
            raise InvalidInputError("pass a KeyedJaggedBatch alone, without offsets")
        parts = ids.split()
        missing = [t for t in tables if t not in parts]
        if missing:
            raise InvalidInputError(f"keyed batch lacks table(s) {missing}; it has keys {list(ids.keys)}")
        id_list = [parts[t][0] for t in tables]
        off_list = [parts[t][1] for t in tables]
    else:
        if not isinstance(ids, (list, tuple)) or not isinstance(offsets, (list, tuple)):
            raise InvalidInputError("ids and offsets must be per-table lists of int64 tensors "
                                    "(or pass one KeyedJaggedBatch)")
        if len(ids) != len(tables) or len(offsets) != len(tables):
            raise InvalidInputError(f"expected {len(tables)} ids and offsets tensors (tables {list(tables)}), "
                                    f"got {len(ids)} and {len(offsets)}")
        id_list = [as_ids(x, f"ids[{i}]")[0] for i, x in enumerate(ids)]
        off_list = [as_offsets(o, len(a)) for a, o in zip(id_list, offsets)]
    sizes = {len(o) - 1 for o in off_list}
    if len(sizes) > 1:
        raise InvalidInputError(f"every table needs the same number of bags; got {[len(o) - 1 for o in off_list]}")
    return id_list, off_list
