"""What ``kvstore serve`` refuses in a config before it opens anything: one list, run by ``serve`` and by
``kvstore config check``, so a config the check passes is a config the daemon starts on.

Each problem names the field and the file. Checks that need the machine (a port in use, a data
directory another process holds, a damaged LMDB file) stay with the start: they are not properties of
the config.
"""

from __future__ import annotations

from kvstore.config.schema import KVStoreConfig
from kvstore.config.units import format_size

DISK_TIERS = ("lmdb", "file", "slab")


def serve_problems(cfg: KVStoreConfig, source: str) -> list[str]:
    """Why ``kvstore serve`` refuses ``cfg`` read from ``source``, each naming its field; empty: it starts."""
    problems: list[str] = []
    where = f"invalid config {source}"
    if "host" not in cfg.tiers:
        problems.append(f"{where}: tiers {cfg.tiers} lacks 'host'; kvstore serve needs it (its shared-memory arena "
                        "is how engines exchange blocks)")
    if "remote" in cfg.tiers and cfg.remote.write == "write_back" and not set(cfg.tiers) & set(DISK_TIERS):
        problems.append(f"{where}: remote.write: write_back sends a group when its block leaves the daemon's disk "
                        f"tier, and tiers {cfg.tiers} names none; add lmdb, or use write_through or "
                        "write_through_selective")
    if cfg.daemon.layouts == "any":
        if cfg.daemon.events.enabled:
            problems.append(f"{where}: daemon.events publishes one layout's blocks (a router keys them by one block "
                            "size): it needs daemon.layouts: model")
        problems += [f"{where}: tiers: {name} keeps one layout's blocks; with daemon.layouts: any the layouts share "
                     "the disk through lmdb (or no disk tier)" for name in cfg.tiers if name in ("file", "slab")]
        if "lmdb" in cfg.tiers:
            from kvstore.tiers.lmdb.env import block_budget

            if block_budget(int(cfg.disk.max_size)) <= 0:
                problems.append(f"{where}: disk.max_size {format_size(int(cfg.disk.max_size))} leaves LMDB no room "
                                "for blocks (it keeps 16 pages and a sixteenth for its own); give at least 1MiB")
        return problems  # each layout's block size is checked against the capacities when its first client comes
    sized = [(name, field, int(value)) for name, field, value in (
        ("host", "host.capacity", cfg.host.capacity), ("lmdb", "disk.max_size", cfg.disk.max_size))
        if name in cfg.tiers]
    widest = cfg.model.widest_layout().bytes_per_block  # without torch: what `config check` must not import
    if any(value < widest for _, _, value in sized):
        layout = cfg.model.layout()  # the dtype `auto` stands for on this machine (imports torch)
        shape = (f"the model: section's layout, {layout.num_layers} layers x {layout.num_kv_heads} KV heads x "
                 f"{layout.head_dim} x {layout.block_size} tokens in {layout.dtype}")
        problems += [f"{where}: {field} {format_size(value)} holds no block of {format_size(layout.bytes_per_block)} "
                     f"({shape}); give at least that" for _, field, value in sized if value < layout.bytes_per_block]
    return problems
