"""The host-RAM tier: its arena of slots (plain, pinned, shared memory), the slot directory clients read, prefaulting."""
