"""Training with tables larger than memory (SPEC section 3).

``TieredEmbeddingBagCollection`` pools embedding bags straight out of a store
and applies a fused row-wise optimizer in backward; ``pipeline``/``prefetch``
keep the rows of the next k batches in a working set ahead of the compute.
``DLRM`` (and DCNv2 as its interaction option) is built on it; ``embstore
train CONFIG.toml`` runs the whole loop (``trainer.py``).
"""

from embstore.training.batch import KeyedJaggedBatch
from embstore.training.dlrm import DLRM
from embstore.training.ebc import TieredEmbeddingBagCollection
from embstore.training.optim import OPTIMIZERS, OptimConfig, state_dim

__all__ = ["DLRM", "KeyedJaggedBatch", "OPTIMIZERS", "OptimConfig", "TieredEmbeddingBagCollection", "state_dim"]
