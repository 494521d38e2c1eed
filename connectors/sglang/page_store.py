"""Where the SGLang backend keeps pages: kvstore's in-process stack, or a ``kvstore serve`` daemon.

Both are a :class:`~kvstore.tiers.base.Tier` (whole blocks of ``layout.bytes_per_block`` bytes under
32-byte keys), which is exactly what SGLang's HiCache L3 interface asks for: ``contains_prefix`` is its
``batch_exists``, ``get``/``put`` its batched page reads and writes.

- ``connector: embedded``: :class:`~kvstore.lower.local.LocalTier`, the host tier in front of the
  configured disk tier, run by the code that runs them inside the daemon.
- ``connector: sidecar``: :class:`~kvstore.daemon.client.tier.DaemonTier`, the daemon's shared-memory host tier
  in front of its disk tier; pages survive the SGLang process and are shared by every engine on the host.
"""

from __future__ import annotations

from kvstore.config.schema import KVStoreConfig
from kvstore.daemon.client.tier import DaemonTier
from kvstore.lower.local import LocalTier
from kvstore.tiers.base import Tier

CONNECT_WAIT_S = 10.0
"""How long opening a sidecar store waits for the daemon to answer."""


def open_page_store(cfg: KVStoreConfig, client_name: str) -> Tier:
    """The page store ``cfg.connector`` names, for the layout ``cfg.model`` describes.

    ``sidecar`` connects to ``cfg.daemon.socket_path`` (waiting up to
    :data:`CONNECT_WAIT_S`) and raises
    :class:`~kvstore.daemon.client.connection.DaemonUnavailable` if nothing answers, or
    :class:`~kvstore.daemon.wire.frames.DaemonError` if the daemon refuses the
    handshake (wrong token, a different ``model`` section).
    """
    layout = cfg.model.layout()
    if cfg.connector == "embedded":
        return LocalTier.from_config(cfg, layout)
    return DaemonTier.from_config(cfg, client_name, CONNECT_WAIT_S, layout)
