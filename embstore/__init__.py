"""embstore: a tiered embedding store for recommendation models.

    store = embstore.create("path", "config.toml")   # or an embstore.StoreConfig
    rows = store["user_id"].lookup(ids)
"""

import embstore.numba_cache  # noqa: F401  first: numba cache locators must precede every @njit(cache=True)
from embstore.config import (HashConfig, InitConfig, PolicySpec, RowDType, StoreConfig, TableConfig,
                             TierConfig, TierKind)
from embstore.errors import (ConfigError, CorruptStoreError, DiskFullError, EmbstoreError, IdOutOfRangeError,
                             InvalidInputError, InvalidOffsetsError, InvalidRowsError, StoreClosedError, StoreInUseError,
                             StoreError, StoreExistsError, StoreNotFoundError, TableExistsError, TierIOError,
                             UnknownTableError)
from embstore.store import Store, create, open
from embstore.table import Table

__version__ = "0.1.0"

__all__ = [
    "ConfigError",
    "CorruptStoreError",
    "DiskFullError",
    "EmbstoreError",
    "HashConfig",
    "IdOutOfRangeError",
    "InitConfig",
    "InvalidInputError",
    "InvalidOffsetsError",
    "InvalidRowsError",
    "PolicySpec",
    "RowDType",
    "Store",
    "StoreClosedError",
    "StoreConfig",
    "StoreError",
    "StoreExistsError",
    "StoreInUseError",
    "StoreNotFoundError",
    "Table",
    "TableConfig",
    "TableExistsError",
    "TierConfig",
    "TierIOError",
    "TierKind",
    "UnknownTableError",
    "create",
    "open",
]
