"""Raw id -> row mappings: hashing trick, QR trick, learned hash functions.

Every mapper (see :class:`~embstore.hashing.base.Mapper`) has ``num_rows``,
``rows_per_id``, ``__call__(ids) -> rows``, ``physical_dim(dim)``,
``combine(parts)`` and ``mapping_bytes``; ``build_hash`` makes the one a
table's :class:`~embstore.config.HashConfig` asks for.
"""

from embstore.hashing.base import Mapper
from embstore.hashing.factory import build_hash
from embstore.hashing.learned import LearnedHash
from embstore.hashing.mod import ModHash
from embstore.hashing.qr import QRHash

__all__ = ["LearnedHash", "Mapper", "ModHash", "QRHash", "build_hash"]
