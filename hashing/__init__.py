"""Raw id -> row mappings: hashing trick, QR trick, learned hash functions."""
