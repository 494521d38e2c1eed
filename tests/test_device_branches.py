"""Every branch that runs only on a GPU, driven on the CPU.

A ``meta`` tensor stands in for device memory (its device is not the CPU, so
copies take the device branch; it holds no data), and CUDA-only calls
(``torch.cuda.is_available``, events, ``cudaHostRegister``) are replaced by
recording fakes. Where the bytes must really move (a prefix load through the
store), the pool stays on the CPU and fake copy streams take the stream path.
``benchmarks/gpu_check.sh`` runs the same paths on real CUDA.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from engine import EngineConfig
from engine.kernels import select_backend
from kvstore.bench.machine import describe_machine
from kvstore.config.schema import PolicyConfig
from kvstore.errors import TierError
from kvstore.store.gpu_pool import GPUBlockPool, default_device
from kvstore.store.host_slot import HostSlot
from kvstore.layout import KVLayout
from kvstore.store.tiered import TieredStore
from kvstore.tiers.host.arena import HostArena, resolve_pin
from kvstore.tiers.host.tier import HostTier
from kvstore.store.transfer import (
    CudaCopyStreams,
    LayerSync,
    copy_blocks,
    copy_bytes,
    copy_layer,
    default_copy_streams,
    staging_buffer,
)


class CopySpy:
    """Records each ``Tensor.copy_`` call's devices and ``non_blocking`` flag, then does the copy."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, bool]] = []
        self._orig = torch.Tensor.copy_

    def copy_(self, dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        self.calls.append((dst.device.type, src.device.type, non_blocking))
        if src.device.type == "meta" and dst.device.type != "meta":
            return dst  # a meta source has no data to copy out
        return self._orig(dst, src, non_blocking=non_blocking)


@pytest.fixture
def copy_spy(monkeypatch: pytest.MonkeyPatch) -> CopySpy:
    spy = CopySpy()

    def copy_(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        return spy.copy_(dst, src, non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    return spy


@pytest.fixture
def cuda_available(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make torch report a CUDA device (nothing here may then touch real CUDA memory)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


# ------------------------------------------------------------------ transfer.copy_bytes
def test_copy_into_the_device_is_one_async_copy(copy_spy: CopySpy) -> None:
    dst = torch.empty(64, dtype=torch.uint8, device="meta")
    src = torch.arange(64, dtype=torch.uint8)
    assert copy_bytes(dst, src) is dst  # the original recursed here (RecursionError)
    assert copy_spy.calls == [("meta", "cpu", True)]


def test_copy_out_of_the_device_is_synchronous(copy_spy: CopySpy) -> None:
    # The caller reads the host buffer right away (disk write, published host slot).
    dst = torch.zeros(64, dtype=torch.uint8)
    src = torch.empty(64, dtype=torch.uint8, device="meta")
    assert copy_bytes(dst, src) is dst
    assert copy_spy.calls == [("cpu", "meta", False)]


def test_host_to_host_copy_does_not_use_copy_(copy_spy: CopySpy) -> None:
    dst, src = torch.zeros(64, dtype=torch.uint8), torch.arange(64, dtype=torch.uint8)
    copy_bytes(dst, src)
    assert torch.equal(dst, src) and copy_spy.calls == []


def test_layer_and_block_copies_into_a_device_pool(layout: KVLayout, copy_spy: CopySpy) -> None:
    pool = GPUBlockPool(layout, 4, device="meta")
    dsts = [pool.block_bytes(b) for b in pool.allocate(2)]
    srcs = [torch.full((layout.bytes_per_block,), i, dtype=torch.uint8) for i in range(2)]
    for layer in range(layout.num_layers):
        copy_layer(layout, dsts, srcs, layer)
    copy_blocks(dsts, srcs)
    assert copy_spy.calls == [("meta", "cpu", True)] * (2 * layout.num_layers + 2)


# ------------------------------------------------------------------ transfer.staging_buffer
def test_staging_buffer_is_pinned_when_cuda_is_available(
    layout: KVLayout, cuda_available: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    pinned: list[int] = []

    def fake_pin(t: torch.Tensor) -> torch.Tensor:
        pinned.append(t.numel())
        return t

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    assert staging_buffer(layout, pin=True).numel() == layout.bytes_per_block
    assert pinned == [layout.bytes_per_block]
    staging_buffer(layout, pin=False)
    assert pinned == [layout.bytes_per_block]


# ------------------------------------------------------------------ transfer.LayerSync
class FakeEvents:
    """Stream events as plain records: which stream each was recorded on, which were waited for."""

    def __init__(self) -> None:
        self.recorded: list[tuple[int, object]] = []
        self.waited: list[object] = []

    def record(self, stream: Any) -> object:
        ev = ("event", len(self.recorded), stream)
        self.recorded.append((len(self.recorded), stream))
        return ev

    def wait(self, event: object) -> None:
        self.waited.append(event)


def test_layer_sync_on_cuda_records_and_waits_for_stream_events() -> None:
    events = FakeEvents()
    sync = LayerSync(3, events=events)
    assert sync.on_streams
    stream = object()
    sync.mark(0, stream)  # type: ignore[arg-type]  # a fake stream: only the events see it
    sync.mark(1, stream)  # type: ignore[arg-type]
    assert events.recorded == [(0, stream), (1, stream)]
    assert sync.wait(1, timeout=0) and events.waited == [("event", 1, stream)]
    assert not sync.wait(2, timeout=0) and events.waited == [("event", 1, stream)]
    sync.mark_all()
    assert sync.wait(2, timeout=0) and events.waited == [("event", 1, stream)]  # no event for layer 2


def test_layer_sync_on_the_cpu_uses_no_stream_events() -> None:
    sync = LayerSync(2)
    assert not sync.on_streams
    sync.mark(0, None)
    sync.mark(1, object())  # type: ignore[arg-type]  # ignored: plain copies, no stream events
    assert sync.wait(0, timeout=0) and sync.wait(1, timeout=0)


# ------------------------------------------------------------------ prefetch: loads on copy streams
class FakeCopyStreams(FakeEvents):
    """Copy streams as records in one ordered ``log``, shared with the store's host-slot releases.

    The copies themselves run on the CPU (the pool is a CPU pool), so the
    bytes really move; ``synchronize`` notes how many host slots are pinned.
    """

    def __init__(self, host: HostTier) -> None:
        super().__init__()
        self.host = host
        self.streams: list[str] = []
        self.current: str | None = None
        self.log: list[tuple[object, ...]] = []

    def new_stream(self) -> Any:
        stream = f"stream-{len(self.streams)}"
        self.streams.append(stream)
        self.log.append(("new", stream))
        return stream

    @contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        self.log.append(("use", stream))
        self.current = stream
        try:
            yield
        finally:
            self.current = None
            self.log.append(("end use", stream))

    def record(self, stream: Any) -> object:
        self.log.append(("record", stream, self.current))
        return super().record(stream)

    def synchronize(self, stream: Any) -> None:
        self.log.append(("synchronize", stream, self.host.num_pinned))


def _prefill(store: TieredStore, tokens: list[int], seed: int) -> list[torch.Tensor]:
    """Allocate, write distinct KV, commit and free the blocks of ``tokens``; returns what was written."""
    keys = store.keys(tokens)
    blocks = store.allocate(len(keys))
    g = torch.Generator().manual_seed(seed)
    data = [torch.randint(0, 256, (store.layout.bytes_per_block,), dtype=torch.uint8, generator=g) for _ in blocks]
    for b, d in zip(blocks, data):
        store.pool.block_bytes(b).copy_(d)
    store.commit(keys, blocks, tokens)
    store.free(blocks)
    return data


def test_a_load_on_copy_streams_synchronizes_before_it_releases_the_host_slots(
    layout: KVLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The host slot a load reads must stay pinned until the asynchronous copies are done:
    # released earlier, it could be reused (overwritten) while the DMA still reads it.
    pool = GPUBlockPool(layout, 2, device="cpu")
    host = HostTier(layout, 4 * layout.bytes_per_block, auto_evict=False)
    streams = FakeCopyStreams(host)
    store = TieredStore(layout, pool, host, None, PolicyConfig(write="write_back"), copy_streams=streams)
    loading: set[bytes] = set()  # keys of the running load (acquire also spills, and releases those slots)
    release = store.h.placement.release

    def logged_release(handle: HostSlot) -> None:
        if handle.key in loading:
            streams.log.append(("release", handle.key, handle.slot))
        release(handle)

    monkeypatch.setattr(store.h.placement, "release", logged_release)
    a, b = list(range(0, 2 * layout.block_size)), list(range(100, 100 + 2 * layout.block_size))
    data = {0: _prefill(store, a, seed=1), 1: _prefill(store, b, seed=2)}  # a pool of 2: a went to host
    streams.log.clear()
    n = layout.num_layers
    for load, tokens in enumerate((a, b)):  # loading a sends b to host: two loads from host
        match = store.lookup(tokens)
        assert match.tiers == ("host", "host")
        keys = list(match.keys)
        slots = [host.slot_of(k) for k in keys]
        loading.update(keys)
        lease = store.acquire(match)
        lease.resolve()
        lease.wait()
        stream = f"stream-{load}"
        assert streams.log == [
            ("new", stream),
            ("use", stream),
            *[("record", stream, stream)] * n,  # each layer marked on the load's stream, inside use()
            ("end use", stream),
            ("synchronize", stream, 2),  # both host slots still pinned by the lease
            *[("release", k, s) for k, s in zip(keys, slots)],
        ]
        assert streams.recorded == [(i, stream) for i in range(n)]
        assert streams.waited == [("event", i, stream) for i in range(n)]
        assert lease.tokens_by_tier() == {"gpu": 0, "host": 2 * layout.block_size, "disk": 0}
        got = [store.pool.block_bytes(blk).clone() for blk in lease.block_ids]
        assert all(torch.equal(x, y) for x, y in zip(got, data[load], strict=True))  # the bytes stored
        store.release(lease)
        assert host.num_pinned == 0
        streams.log.clear(), streams.recorded.clear(), streams.waited.clear(), loading.clear()
    assert streams.streams == ["stream-0", "stream-1"]
    store.check_integrity()


def test_copy_streams_default_to_cuda_for_a_cuda_pool_only() -> None:
    assert isinstance(default_copy_streams(torch.device("cuda")), CudaCopyStreams)
    assert default_copy_streams(torch.device("cpu")) is None
    assert default_copy_streams(torch.device("meta")) is None


# ------------------------------------------------------------------ device defaults
def test_defaults_pick_cuda_when_available(cuda_available: None) -> None:
    assert default_device() == torch.device("cuda")
    cfg = EngineConfig()
    assert cfg.torch_device() == torch.device("cuda") and cfg.kv_dtype_name() == "bfloat16"
    assert EngineConfig(device="cpu").kv_dtype_name() == "float32"


def test_auto_backend_on_cuda_is_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the compiled kernels: CUDA needs no interpreter
    assert select_backend("auto", "cuda").name == "triton"
    assert select_backend("triton", torch.device("cuda")).name == "triton"


def test_machine_description_names_the_gpu(cuda_available: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: f"Fake GPU {index}")
    assert describe_machine()["cuda"] == "Fake GPU 0"


# ------------------------------------------------------------------ host arena pinning
class FakeCudart:
    def __init__(self, err: int = 0) -> None:
        self.err = err
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802  (the CUDA name)
        self.registered.append((ptr, nbytes, flags))
        return self.err

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_pin_modes_with_cuda(cuda_available: None) -> None:
    assert resolve_pin("auto") and resolve_pin("always") and not resolve_pin("never")


def test_host_arena_registers_and_unregisters_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    arena = HostArena.allocate(3, 64, pin=True)
    assert arena.tensor is not None
    ptr = arena.tensor.data_ptr()
    assert arena.pinned and cudart.registered == [(ptr, 3 * 64, 0)]
    arena.close()
    assert not arena.pinned and cudart.unregistered == [ptr]
    arena.close()
    assert cudart.unregistered == [ptr]


def test_host_arena_reports_a_failed_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart(err=2))
    with pytest.raises(TierError, match="cudaHostRegister of 192 bytes failed with CUDA error 2"):
        HostArena.allocate(3, 64, pin=True)
