"""The LMDB disk tier: the environment, batched reads, checks of damaged files and values, repair."""
