"""Training with tables larger than memory (SPEC section 3).

``TieredEmbeddingBagCollection`` pools embedding bags straight out of a store
and applies a fused row-wise optimizer in backward; ``pipeline``/``prefetch``
keep the rows of the next k batches in a working set ahead of the compute.
"""

from embstore.training.batch import KeyedJaggedBatch
from embstore.training.ebc import TieredEmbeddingBagCollection
from embstore.training.optim import OPTIMIZERS, OptimConfig, state_dim

__all__ = ["KeyedJaggedBatch", "OPTIMIZERS", "OptimConfig", "TieredEmbeddingBagCollection", "state_dim"]
