"""Training with tables larger than memory: TieredEmbeddingBagCollection, DLRM."""
