"""The opt-in slab disk tier: an O_DIRECT data file of fixed-size slots and its LMDB index, repair."""
