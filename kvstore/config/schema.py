"""The one typed config of the service, section by section.

Every field has a docstring (shown by ``kvstore config check`` and mirrored in
``configs/default.yaml``), a default and bounds; choices are ``Literal``s.
Unknown keys are errors (``extra="forbid"``), so a typo never passes silently.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, ConfigDict, Field, model_validator

from kvstore.config.datadirs import DataRole, default_data_dir
from kvstore.config.deadlines import DeadlinesConfig
from kvstore.config.events import EventsConfig
from kvstore.config.remote import RemoteConfig
from kvstore.config.section import Section
from kvstore.config.units import PositiveSize, Size
from kvstore.config.write_policy import SELECTIVE_HITS_DEFAULT, WritePolicy
from kvstore.frame_bounds import least_max_frame_bytes
from kvstore.layout import DTypeName, KVLayout, auto_dtype
from kvstore.policy.named import DEFAULT_PLACEMENT, PlacementPolicy, placement_policy


TierName = Literal["host", "lmdb", "file", "slab", "remote"]
"""A tier below the GPU, by its YAML name."""


DISK_TIERS: tuple[TierName, ...] = ("lmdb", "file", "slab")
"""The disk tiers; ``tiers`` names at most one."""


def _default_tiers() -> list[TierName]:
    return ["host", "lmdb"]


def _set_path(path: str | None, field: str) -> str:
    if path is None:
        raise ValueError(f"{field} is unset: KVStoreConfig.for_role(role) gives each kind of process its default "
                         "directory; set it before opening the tier")
    return path


class ModelConfig(Section):
    """The model whose KV cache is stored: its layout and identity.

    The defaults describe the engine's default model, SmolLM2-135M-Instruct
    (Q4_1 GGUF), with the engine's default block size and dtype, so a daemon on
    the default config serves an engine on the default model as it is. An
    engine refused at login (another model) is told which fields differ.
    """

    model_id: str = "SmolLM2-135M-Instruct.Q4_1.gguf@a6e5483379026e79"
    """Name of the weights; part of every block key, so models never share blocks. The engine derives it from
    the checkpoint's files (``engine/model_id.py``; ``<file or directory name>@<digest>``) unless given one; the
    default is that of SmolLM2-135M-Instruct (Q4_1), the engine's default model."""
    num_layers: int = Field(30, gt=0, le=1024)
    """Transformer layers."""
    num_kv_heads: int = Field(3, gt=0, le=1024)
    """Key/value heads per layer (fewer than query heads under GQA)."""
    head_dim: int = Field(64, gt=0, le=4096)
    """Dimension of one head."""
    block_size: int = Field(16, gt=0, le=4096)
    """Tokens per KV block (the unit of paging, hashing and transfer); the engine's default is 16."""
    dtype: Literal["auto", "float16", "bfloat16", "float32"] = "auto"
    """Element type of the KV cache. ``auto`` is what the engine uses by default: bfloat16 where CUDA is available,
    float32 elsewhere."""

    def kv_dtype(self) -> DTypeName:
        """:attr:`dtype` with ``auto`` resolved on this machine (imports torch to ask whether CUDA is available)."""
        if self.dtype != "auto":
            return self.dtype
        import torch

        return auto_dtype("cuda" if torch.cuda.is_available() else "cpu")

    def layout(self, dtype: DTypeName | None = None) -> KVLayout:
        """The :class:`KVLayout` this section describes; ``dtype`` replaces :meth:`kv_dtype` when given."""
        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=self.block_size,
            dtype=dtype or self.kv_dtype(),
            model_id=self.model_id,
        )

    def widest_layout(self) -> KVLayout:
        """The layout with the largest block :attr:`dtype` can stand for (float32 for ``auto``), without torch."""
        return self.layout("float32" if self.dtype == "auto" else self.dtype)


class GPUConfig(Section):
    """The GPU block pool (L1)."""

    num_blocks: int = Field(1024, gt=0, le=10_000_000)
    """Blocks preallocated in the pool."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """Where the pool lives: ``auto`` picks CUDA when available, else the CPU."""


class HostConfig(Section):
    """The host-RAM tier (L2)."""

    capacity: Size = "1GiB"  # type: ignore[assignment]
    """Bytes of the preallocated slot arena (rounded down to whole blocks)."""
    pin_memory: Literal["auto", "always", "never"] = "auto"
    """Pin the arena for fast DMA: ``auto`` pins only when CUDA is available."""
    prefault: bool = True
    """Map the arena's pages on a background thread from start (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+), so
    puts into fresh slots take no page fault per 4 KiB; the arena's RAM is then in use from start, as a pinned
    arena's is. Clients of ``kvstore serve`` map their view of the segment ahead the same way. ``false``: pages
    are mapped by the first put into each slot."""
    shared_memory: bool = False
    """Back the arena with a sealed shared-memory file whose descriptor other processes can map (``kvstore serve``
    always does, and passes it to its local clients at login)."""


class DiskConfig(Section):
    """The NVMe tier (L3) in an LMDB environment."""

    path: str | None = None
    """Directory of the LMDB environment (relative paths are relative to the working directory). Unset (``null``):
    each kind of process has its own, so they never share one by accident: ``.kvstore-data/lmdb`` for ``kvstore
    serve``, ``.kvstore-data/embedded/lmdb`` for a store in an engine's process (``connector: embedded``),
    ``.kvstore-data/demo/lmdb`` for ``kvstore demo``. One directory admits one process at a time."""
    max_size: PositiveSize = "8GiB"  # type: ignore[assignment]
    """Hard cap on the LMDB file; blocks are evicted to stay under it. 1/16 of it is kept as headroom for
    LMDB's own pages, so blocks use at most 15/16 (the capacity ``kvstore stats`` shows)."""
    codec: Literal["none", "zstd", "shuffle_zstd"] = "none"
    """Payload encoding: raw, zstd, or zstd after splitting high and low bytes of each element."""
    codec_level: int = Field(1, ge=1, le=22)
    """zstd compression level (1 is fastest)."""
    sync: Literal["always", "interval"] = "interval"
    """``always``: every put is durable when acknowledged. The tier fsyncs each commit, and ``kvstore serve``
    answers a put (PUT_INLINE, PUT_SHM_COMMIT) only after its blocks are written and synced (concurrent
    puts share one commit), whatever ``policy.write`` says; a block whose write failed is answered as not
    stored. Survives kill -9 of the daemon and power loss. ``interval``: faster. The daemon acknowledges a
    put once its blocks are in the host tier and writes them behind (at commit under ``policy.write:
    write_through``, else when host room runs low, at FLUSH and at a clean stop); the tier fsyncs every ``sync_interval_ms`` or ``sync_bytes``,
    whichever comes first. Only what a FLUSH (or a clean SIGTERM) acknowledged is guaranteed: kill -9 of
    the daemon loses puts not yet written, an OS crash or power loss at most the last sync window."""
    sync_interval_ms: int = Field(200, ge=1, le=3_600_000)
    """Longest time between syncs under ``sync: interval``."""
    sync_bytes: Size = "64MiB"  # type: ignore[assignment]
    """Most unsynced bytes under ``sync: interval``."""
    io_threads: int = Field(2, ge=1, le=64)
    """Threads doing disk I/O so callers never block on the disk."""
    read_threads: int = Field(4, ge=1, le=64)
    """Threads one large get is split over (contiguous runs of at least 1 MiB, each in its own read
    transaction), so several cold reads are in flight at once; 1 reads on the calling thread only."""
    def directory(self) -> str:
        """:attr:`path`; ``ValueError`` when unset (:meth:`KVStoreConfig.for_role` sets each process's default)."""
        return _set_path(self.path, "disk.path")


class FileConfig(Section):
    """The file-per-block tier (the baseline LMCache and SGLang use); used when ``tiers`` names ``file``."""

    path: str | None = None
    """Directory holding one file per block. Unset (``null``): as for ``disk.path``, one per kind of process,
    ``.kvstore-data/files``, ``.kvstore-data/embedded/files`` or ``.kvstore-data/demo/files``."""
    max_size: PositiveSize = "8GiB"  # type: ignore[assignment]
    """Hard cap on stored bytes."""
    codec: Literal["none", "zstd", "shuffle_zstd"] = "none"
    """Payload encoding, as for the disk tier."""
    codec_level: int = Field(1, ge=1, le=22)
    """zstd compression level."""
    def directory(self) -> str:
        """:attr:`path`; ``ValueError`` when unset (:meth:`KVStoreConfig.for_role` sets each process's default)."""
        return _set_path(self.path, "file.path")


class SlabConfig(Section):
    """The slab disk tier: fixed-size slots of one data file written with ``O_DIRECT``, an LMDB index of key ->
    slot; used when ``tiers`` names ``slab`` (opt-in; see docs/DESIGN.md "slab")."""

    path: str | None = None
    """Directory holding ``slots.dat`` and the ``index`` LMDB environment. Unset (``null``): as for ``disk.path``,
    one per kind of process, ``.kvstore-data/slab``, ``.kvstore-data/embedded/slab`` or ``.kvstore-data/demo/slab``."""
    max_size: PositiveSize = "8GiB"  # type: ignore[assignment]
    """Hard cap on the data file: ``max_size // slot`` slots, a slot being one block plus its 48-byte header
    rounded up to 4 KiB. The index adds about 100 bytes per block."""
    codec: Literal["none"] = "none"
    """Payload encoding; only ``none`` (slots are fixed-size)."""
    sync: Literal["always", "interval"] = "interval"
    """``always``: each put fdatasyncs the data file, then commits its index entries with an fsync, before it
    returns. ``interval``: the data is written straight to the device (``O_DIRECT``) but synced, data file
    first and index second, every ``sync_interval_ms`` and on ``flush``; as for ``disk.sync``."""
    sync_interval_ms: int = Field(200, ge=1, le=3_600_000)
    """Longest time between syncs under ``sync: interval``."""
    io_threads: int = Field(2, ge=1, le=64)
    """Threads running ``get_async``/``put_async`` so callers never block on the disk."""
    read_threads: int = Field(4, ge=1, le=64)
    """Reads of one get in flight at once (each a run of consecutive slots)."""
    grow_step: PositiveSize = "256MiB"  # type: ignore[assignment]
    """The data file is preallocated (``posix_fallocate``) in steps of this many bytes, up to ``max_size``."""
    direct_io: bool = True
    """Write and read the data file with ``O_DIRECT`` (bypassing the page cache); ``false``, or a file system
    that refuses it (tmpfs), uses buffered I/O."""

    def directory(self) -> str:
        """:attr:`path`; ``ValueError`` when unset (:meth:`KVStoreConfig.for_role` sets each process's default)."""
        return _set_path(self.path, "slab.path")


class PolicyConfig(Section):
    """Placement, write and prefetch policies."""

    write: WritePolicy = "write_back"
    """When committed blocks are copied down: at once (``write_through``), after ``selective_hits`` hits, or only
    when they leave the tier above (``write_back``, the default: under ``placement: adaptive`` host and disk then
    hold distinct blocks, so the tiers add capacity; measured in docs/BENCHMARKS.md "hitrate"). Under every
    policy a flush (``TieredStore.flush``, a connector's ``flush`` and ``close``) first writes every committed
    block the disk tier lacks down to it, and a block on disk stays there until the disk's own capacity
    evicts it, so what a flush acknowledged survives a crash. A daemon below the GPU (``connector: sidecar``) is
    written through under ``write_back`` too: other engines read it, so a block reaches it when committed.
    The daemon (and the engine adapters' in-process stack) applies it between its own host and disk tiers:
    under ``write_back`` a committed block stays in host only, dirty, until host room runs low, a FLUSH or a
    clean stop writes it down (a kill -9 loses the dirty ones: misses afterwards, never wrong data); with
    ``disk.sync: always`` it writes at commit whatever this says."""
    selective_hits: int = Field(SELECTIVE_HITS_DEFAULT, ge=1, le=1_000_000)
    """Hits before a block is written down under ``write_through_selective``."""
    prefetch: Literal["best_effort", "wait_complete", "timeout"] = "wait_complete"
    """How long a request waits for its prefix to load before recomputing the rest."""
    prefetch_timeout_base_ms: float = Field(50.0, ge=0, le=600_000)
    """Fixed part of the ``timeout`` budget."""
    prefetch_timeout_per_1k_tokens_ms: float = Field(10.0, ge=0, le=600_000)
    """Budget added per 1000 prefix tokens under ``timeout``."""
    max_inflight_bytes: PositiveSize = "256MiB"  # type: ignore[assignment]
    """Bound on bytes being loaded at once; further loads wait (backpressure)."""
    placement: Literal["lru", "s3fifo", "gdsf", "adaptive"] = DEFAULT_PLACEMENT  # type: ignore[assignment]
    """How the host and disk tiers choose what to give up, and whether use counts follow blocks between tiers
    (:mod:`kvstore.policy.named`; measured in docs/BENCHMARKS.md "hitrate"). ``adaptive`` (the default): GDSF
    with damped counts or S3-FIFO, chosen online for host and disk together by which one hits more on a
    sample, counts carried between tiers and remembered for blocks that left, and under ``write: write_back``
    (the default) host and disk holding distinct blocks. ``lru``: least recently used first. ``s3fifo``: scan-resistant FIFO queues.
    ``gdsf``: lowest ``L + use count`` first, counts carried."""

    def placement_policy(self) -> PlacementPolicy:
        """The named policy :attr:`placement` selects."""
        return placement_policy(self.placement)


class DaemonConfig(Section):
    """The sidecar daemon (``kvstore serve``)."""

    # validate_by_name: fields are set by their own names; ``hold_timeout_s`` also takes its deprecated name.
    model_config = ConfigDict(**Section.model_config, validate_by_name=True)

    socket_path: str = ".kvstore-data/kvstore.sock"
    """Unix domain socket of the control plane (created with mode 0600)."""
    tcp_host: str | None = None
    """Optional TCP listen address for remote clients; ``null`` disables TCP."""
    tcp_port: int = Field(7390, ge=1, le=65535)
    """TCP port when ``tcp_host`` is set."""
    token: str | None = None
    """Shared secret clients must present; required when TCP is enabled."""
    tenant_salts: dict[str, str] = Field(default_factory=dict)
    """Map from client token to tenant salt. A client that logs in with one of these tokens is that
    tenant: the daemon namespaces every key it sends by the tenant (it can never reach another tenant's
    blocks, nor those of untenanted local clients), serves it inline only (no shared memory), and shows
    it only its own counters in STATS. The salt is also sent to the client for its key chain."""
    hold_timeout_s: float = Field(30.0, gt=0, le=86_400, validation_alias=AliasChoices("hold_timeout_s", "lease_timeout_s"))
    """A client's holds on host slots (a slot it reads from after GET_SHM, or reserved by PUT_SHM_RESERVE
    to write into) end this many seconds after they were granted, so a vanished client never pins host
    memory for longer. Formerly ``lease_timeout_s``: that deprecated name is still accepted."""
    max_frame_bytes: PositiveSize = "64MiB"  # type: ignore[assignment]
    """Largest accepted protocol frame after login (requests and inline replies); longer ones are refused
    before allocation. Before login a frame may carry at most 4 KiB. At least one block plus 4 KiB."""
    max_inflight_bytes: PositiveSize = "256MiB"  # type: ignore[assignment]
    """Most bytes of frames in flight across all connections: request payloads being received and
    GET_INLINE replies their clients have not yet taken. A frame that does not fit waits, its socket
    unread, until others finish; after ``read_timeout_s`` its connection is closed, naming this limit.
    It bounds what any number of peers can make the daemon hold (one connection holds at most one
    payload and one reply). At least ``max_frame_bytes``."""
    max_keys_per_request: int = Field(16384, ge=1, le=16384)
    """Most block keys one request may carry (every keys request and PUT_INLINE); more is refused
    with an error naming the message type, the count and this limit."""
    login_timeout_s: float = Field(10.0, gt=0, le=3600)
    """A connection that has not completed its login this many seconds after connecting is closed."""
    read_timeout_s: float = Field(30.0, gt=0, le=3600)
    """Once a frame has begun to arrive, all of it must arrive within this many seconds."""
    idle_timeout_s: float = Field(900.0, gt=0, le=604_800)
    """A logged-in connection silent this long between requests is closed (clients reconnect on their
    next request)."""
    max_connections: int = Field(1000, ge=2, le=1_000_000)
    """Most open client connections in all. TCP connections may use at most 7/8 of them, so a flood of
    remote connections always leaves room for local (Unix socket) clients; excess ones are closed at once."""
    max_connections_per_peer: int = Field(64, ge=1, le=1_000_000)
    """Most open connections from one peer (one IP address over TCP, one user id over the Unix socket)."""
    max_login_failures: int = Field(5, ge=1, le=1_000_000)
    """Failed logins one peer may make within ``login_lockout_s``; after that its connections are refused
    at once until the window has passed."""
    login_lockout_s: float = Field(60.0, gt=0, le=86_400)
    """Window over which failed logins are counted, and how long a peer that exceeded them is refused."""
    layouts: Literal["model", "any"] = "any"
    """Which KV layouts the daemon serves. ``any`` (the default): every layout its clients bring (a host runs one
    daemon for all its engines: the built-in one, vLLM, SGLang), each layout's tiers opened on its first client,
    in a directory of its own under the disk tier's, sharing ``host.capacity`` and the disk tier's
    ``max_size``; the ``model`` section is then not used. ``model``: the ``model`` section's layout alone,
    opened at start (needed for ``daemon.events`` and the ``file`` and ``slab`` tiers); an engine on another
    model is refused naming each field that differs."""
    max_layouts: int = Field(8, ge=1, le=256)
    """With ``layouts: any``: the most layouts served at once; a client bringing one more is refused, naming
    the layouts served (each holds an arena, a disk environment and their file descriptors)."""
    max_layouts_per_tenant: int = Field(2, ge=1, le=256)
    """With ``layouts: any`` and ``tenant_salts``: the most layouts one tenant's clients may be on at once (a
    tenant bringing one more is refused, naming its layouts), so one tenant cannot take every one of
    ``max_layouts``. Untenanted clients are the operator's own and count only against ``max_layouts``."""
    max_layout_slots: int = Field(1 << 20, ge=1024, le=1 << 26)
    """With ``layouts: any``: the most host slots one layout's arena has, whatever its block size. A layout's
    bookkeeping grows with its slots (about 32 bytes each before a block is stored: the slot directory local
    clients read), and a client chooses its layout: a legal 4-byte block would otherwise mean ``host.capacity``
    / 4 slots, gigabytes of bookkeeping. At the default, a layout's arena holds ``host.capacity`` whenever its
    blocks are at least ``host.capacity`` / 2^20 bytes (8 KiB at 8 GiB: any real model's block); a layout of
    smaller blocks gets this many slots (logged at its first HELLO)."""
    events: EventsConfig = Field(default_factory=lambda: EventsConfig(endpoint="tcp://127.0.0.1:5559",
                                                                      replay_endpoint="tcp://127.0.0.1:5560"))
    """KV events of the daemon's own tiers (host, disk) for a router (``kvstore route --store``): what the
    engines sharing this daemon can load from it. Separate from the top-level ``events`` section, which an
    engine's own store publishes (so one config file serves both without a port clash). Keys are
    published as the daemon stores them: untenanted clients' keys as sent, a tenant's in its namespace."""

    @model_validator(mode="after")
    def _tcp_needs_token(self) -> "DaemonConfig":
        if self.tcp_host is not None and not self.token:
            raise ValueError("tcp_host is set but token is empty: TCP clients must present a shared-secret token")
        if self.max_connections_per_peer > self.max_connections:
            raise ValueError(f"max_connections_per_peer ({self.max_connections_per_peer}) exceeds "
                             f"max_connections ({self.max_connections})")
        if int(self.max_inflight_bytes) < int(self.max_frame_bytes):
            raise ValueError(f"max_inflight_bytes ({int(self.max_inflight_bytes)}) is less than max_frame_bytes "
                             f"({int(self.max_frame_bytes)}): one largest frame must fit")
        return self

    def min_frame_bytes(self, layout: KVLayout) -> int:
        """Smallest ``max_frame_bytes`` that keeps the daemon usable for ``layout``: one inline block
        with its key and count, and never less than a login frame."""
        return least_max_frame_bytes(layout.bytes_per_block)


class MetricsConfig(Section):
    """HTTP ``/healthz`` and Prometheus ``/metrics``."""

    enabled: bool = True
    """Serve the HTTP endpoints."""
    host: str = "127.0.0.1"
    """Listen address of the HTTP endpoints."""
    port: int = Field(9390, ge=0, le=65535)
    """Port of the HTTP endpoints (0 picks a free one)."""


class LoggingConfig(Section):
    """Log output."""

    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Lowest level logged."""
    format: Literal["text", "json"] = "text"
    """Human-readable lines or one JSON object per line."""


class KVStoreConfig(Section):
    """The whole service."""

    connector: Literal["embedded", "sidecar"] = "embedded"
    """Where the lower tiers live: in the engine's process, or in a ``kvstore serve`` daemon."""
    tiers: list[TierName] = Field(default_factory=_default_tiers)
    """Tiers below the GPU, fastest first, by name: ``host`` (RAM), then one disk tier, ``lmdb``, ``file``
    (one file per block, the baseline) or ``slab`` (O_DIRECT slots, opt-in), then ``remote`` (Redis, shared by a fleet; see ``remote``).
    Any subset in that order; an empty list keeps the cache on the GPU only."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Model layout and identity."""
    gpu: GPUConfig = Field(default_factory=GPUConfig)
    """GPU block pool."""
    host: HostConfig = Field(default_factory=HostConfig)
    """Host-RAM tier."""
    disk: DiskConfig = Field(default_factory=DiskConfig)
    """LMDB disk tier."""
    file: FileConfig = Field(default_factory=FileConfig)
    """File-per-block tier."""
    slab: SlabConfig = Field(default_factory=SlabConfig)
    """Slab disk tier (O_DIRECT slots, LMDB index); used when ``tiers`` names ``slab``."""
    remote: RemoteConfig = Field(default_factory=RemoteConfig)
    """Remote tier on Redis or Valkey (standalone or cluster); used when ``tiers`` names ``remote``."""
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    """Write and prefetch policies."""
    daemon: DaemonConfig = Field(default_factory=DaemonConfig)
    """Sidecar daemon."""
    deadlines: DeadlinesConfig = Field(default_factory=DeadlinesConfig)
    """How long an engine ever waits on the daemon, and its circuit breaker (``connector: sidecar``)."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    """HTTP metrics endpoints."""
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    """Logging."""
    events: EventsConfig = Field(default_factory=EventsConfig)
    """KV events for a KV-cache-aware router (``kvstore route``)."""

    @model_validator(mode="after")
    def _tier_order(self) -> "KVStoreConfig":
        t = self.tiers
        if len(set(t)) != len(t):
            raise ValueError(f"tiers lists a tier twice: {t}")
        disks = [name for name in t if name in DISK_TIERS]
        if len(disks) > 1:
            raise ValueError(f"tiers: choose one disk tier of {', '.join(DISK_TIERS)}, not {' and '.join(disks)}")
        if "host" in t and t[0] != "host":
            raise ValueError(f"tiers: 'host' must come first (fastest first), got {t}")
        if "remote" in t and t[-1] != "remote":
            raise ValueError(f"tiers: 'remote' must come last (fastest first), got {t}")
        return self

    @model_validator(mode="after")
    def _frame_fits_a_block(self) -> "KVStoreConfig":
        # A frame bound below one block plus headers passes field validation but makes every
        # request fail, so it is checked here, where the model layout is known.
        layout = self.model.widest_layout()  # no torch here: ``config check`` stays light
        least = self.daemon.min_frame_bytes(layout)
        if int(self.daemon.max_frame_bytes) < least:
            raise ValueError(
                f"daemon.max_frame_bytes is {int(self.daemon.max_frame_bytes)} bytes; the minimum for this model "
                f"({layout.bytes_per_block} bytes per block) is {least}: one block, its key and the "
                "frame overhead, and at least a login frame"
            )
        return self

    def for_role(self, role: DataRole) -> "KVStoreConfig":
        """A copy with unset ``disk.path`` / ``file.path`` set to ``role``'s default directories (others as given).

        ``kvstore serve`` opens its tiers as ``daemon``, an embedded store as
        ``embedded``, ``kvstore demo`` as ``demo`` (see :mod:`kvstore.config.datadirs`).
        """
        out = self.model_copy(deep=True)
        if out.disk.path is None:
            out.disk.path = default_data_dir(role, "lmdb")
        if out.file.path is None:
            out.file.path = default_data_dir(role, "files")
        if out.slab.path is None:
            out.slab.path = default_data_dir(role, "slab")
        return out
