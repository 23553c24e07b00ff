"""Storage tiers of a table, fastest first: device, dram, mmap, ssd, rocksdb."""
