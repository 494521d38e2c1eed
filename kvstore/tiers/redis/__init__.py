"""The remote tier: groups of blocks in Redis or Valkey (server or cluster), its client, evictions, back-off."""
