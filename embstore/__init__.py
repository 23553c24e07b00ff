"""embstore: a tiered embedding store for recommendation models."""
