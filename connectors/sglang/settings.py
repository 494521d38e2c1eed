"""What the kvstore backend reads from SGLang's ``--hicache-storage-backend-extra-config``, and the layout checks.

The extra config is one JSON object that SGLang hands to every storage
backend (``HiCacheStorageConfig.extra_config``). Besides SGLang's own keys
(``backend_name``, ``module_path``, ``class_name`` for the ``dynamic``
backend, ``interface_v1`` for the page-index I/O path) the kvstore backend
reads:

- ``kvstore_config``: path of the kvstore YAML config (the ``model`` section
  is the layout of one SGLang host page, ``connector`` picks embedded or
  sidecar, the tier and daemon sections as for any kvstore client). Absent:
  ``$KVSTORE_CONFIG``, as for ``kvstore serve``.
- ``tenant``: the tenant salt mixed into every key (a daemon that assigns this
  client a tenant salt overrides it: the trusted side decides the tenant).

Any other key that is not SGLang's is refused by name, so a typo fails at
start-up instead of being ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.layout import KVLayout

EXTRA_CONFIG_FLAG = "--hicache-storage-backend-extra-config"
SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
"""Keys of the extra config that SGLang itself reads for a ``dynamic`` backend."""
KVSTORE_KEYS = frozenset({"kvstore_config", "tenant"})

HOST_BYTE_ORDERS: dict[str, str] = {
    "layer_first": "kv,layer,token,head,dim",
    "page_first_direct": "kv,layer,token,head,dim",
    "page_first": "kv,token,layer,head,dim",
    "page_head": "kv,head,token,layer,dim",
}
"""Order of the elements of one flat host page (``HostKVCache.get_data_page(flat=True)``) per
``--hicache-mem-layout``. It is part of every key: pages of two layouts with the same order
are interchangeable, the others never meet."""

_TORCH_DTYPES = {"torch.float16": "float16", "torch.bfloat16": "bfloat16", "torch.float32": "float32"}


@dataclass(frozen=True)
class BackendSettings:
    """The kvstore part of SGLang's storage extra config."""

    kvstore_config: str | None
    """Path of the kvstore YAML config (``None``: ``$KVSTORE_CONFIG``)."""
    tenant: str | None
    """Tenant salt for every key (``None``: no tenant salt)."""

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> BackendSettings:
        """Read and check the extra config; raises ``ValueError`` naming the flag and the bad key."""
        extra = extra or {}
        unknown = sorted(set(extra) - SGLANG_KEYS - KVSTORE_KEYS)
        if unknown:
            raise ValueError(
                f"{EXTRA_CONFIG_FLAG}: unknown key(s) {unknown} for the kvstore backend; "
                f"it reads {sorted(KVSTORE_KEYS)} besides SGLang's {sorted(SGLANG_KEYS)}"
            )
        values: dict[str, str | None] = {}
        for key in sorted(KVSTORE_KEYS):
            value = extra.get(key)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{EXTRA_CONFIG_FLAG}: {key!r} must be a non-empty string, got {value!r}")
            values[key] = value
        return cls(kvstore_config=values["kvstore_config"], tenant=values["tenant"])


@dataclass(frozen=True)
class HostPageGeometry:
    """What one SGLang host page holds, as its host KV pool describes it."""

    layer_num: int
    head_num: int
    head_dim: int
    v_head_dim: int
    page_size: int
    dtype: str
    mem_layout: str

    @classmethod
    def of(cls, pool: Any) -> HostPageGeometry:
        """Read the geometry of an SGLang MHA host pool (``MHATokenToKVPoolHost``); ``ValueError`` for other pools."""
        missing = [a for a in ("layer_num", "head_num", "head_dim", "page_size", "dtype", "layout") if not hasattr(pool, a)]
        if missing:
            raise ValueError(
                f"the kvstore backend stores pages of an MHA host KV pool; {type(pool).__name__} has no {missing} "
                f"(MLA and hybrid-model pools are not supported)"
            )
        return cls(
            layer_num=int(pool.layer_num), head_num=int(pool.head_num), head_dim=int(pool.head_dim),
            v_head_dim=int(getattr(pool, "v_head_dim", pool.head_dim)), page_size=int(pool.page_size),
            dtype=_TORCH_DTYPES.get(str(pool.dtype), str(pool.dtype)), mem_layout=str(pool.layout),
        )

    @property
    def byte_order(self) -> str:
        """The element order of a flat page (see :data:`HOST_BYTE_ORDERS`)."""
        return HOST_BYTE_ORDERS[self.mem_layout]

    def check_against(self, layout: KVLayout, config_source: str) -> None:
        """Raise ``ValueError`` naming every field of ``model`` in ``config_source`` that differs from the pool.

        One SGLang page is one kvstore block: ``page_size`` tokens of every
        layer, K and V, for this rank's KV heads, so the byte sizes agree
        exactly and no page is ever split or padded.
        """
        if self.mem_layout not in HOST_BYTE_ORDERS:
            raise ValueError(
                f"--hicache-mem-layout {self.mem_layout} is not supported by the kvstore backend; "
                f"use one of {sorted(HOST_BYTE_ORDERS)}"
            )
        if self.v_head_dim != self.head_dim:
            raise ValueError(f"the kvstore backend needs equal K and V head dims, the model has "
                             f"{self.head_dim} and {self.v_head_dim}")
        wanted = {
            "num_layers": (self.layer_num, layout.num_layers),
            "num_kv_heads": (self.head_num, layout.num_kv_heads),
            "head_dim": (self.head_dim, layout.head_dim),
            "block_size": (self.page_size, layout.block_size),
            "dtype": (self.dtype, layout.dtype),
        }
        bad = [f"model.{name} is {have!r} but SGLang's host pool has {want!r}"
               for name, (want, have) in wanted.items() if want != have]
        if bad:
            raise ValueError(
                f"kvstore config {config_source} does not describe SGLang's host KV pages: " + "; ".join(bad)
                + " (block_size is SGLang's --page-size; num_kv_heads is the KV heads of one tensor-parallel rank)"
            )
