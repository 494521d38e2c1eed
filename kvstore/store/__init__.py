"""The tiered store: what an engine's process keeps of the KV cache, and how blocks move between its tiers.

The GPU side and its index live here; the tiers below (host, disk, remote, a daemon) are built by
:mod:`kvstore.lower.build` from :mod:`kvstore.tiers` and reached through the :class:`~kvstore.tiers.base.Tier`
interface, so nothing here imports the daemon.

- :mod:`~kvstore.store.tiered`: :class:`TieredStore`, the API (match, acquire, commit, release, flush);
  :mod:`~kvstore.store.match`, :mod:`~kvstore.store.stats`, :mod:`~kvstore.store.check`: its results, its
  statistics, its cross-checks.
- :mod:`~kvstore.store.gpu_pool` (the paged GPU memory), :mod:`~kvstore.store.radix` with
  :mod:`~kvstore.store.radix_node` and :mod:`~kvstore.store.radix_check` (which prefixes are cached where).
- :mod:`~kvstore.store.hierarchy` (what the parts share), :mod:`~kvstore.store.placement` (the one owner of
  where a block lives), :mod:`~kvstore.store.host_slot` (its handle on a host slot).
- Moving blocks: :mod:`~kvstore.store.spill` (down), :mod:`~kvstore.store.prefetch` (up, under the deadline of
  :mod:`~kvstore.store.load_clock`; :mod:`~kvstore.store.load_cost` decides load or recompute),
  :mod:`~kvstore.store.durable` (flush), :mod:`~kvstore.store.remote_writer` (the remote write policies),
  :mod:`~kvstore.store.transfer` (the copies).

``from kvstore.store import TieredStore`` works for users of the package; inside the project every module
imports a name from the module that defines it. Loaded on first use: the store needs torch, and importing
this package (for the radix index, say) must not pay for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.store.tiered import TieredStore

__all__ = ["TieredStore"]


def __getattr__(name: str) -> Any:
    """Import :class:`TieredStore` (and with it torch) only when it is asked for."""
    if name == "TieredStore":
        from kvstore.store.tiered import TieredStore

        return TieredStore
    raise AttributeError(f"module 'kvstore.store' has no attribute {name!r}")
