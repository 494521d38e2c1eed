"""Block copies between tiers, whole or one layer at a time.

A block is ``[num_layers, 2, block_size, kv_heads, head_dim]`` and contiguous,
so layer ``i`` of a block is the byte range ``[i * L, (i + 1) * L)`` with
``L = bytes_per_block // num_layers``::

    block bytes: | layer 0 (K, V) | layer 1 (K, V) | ... | layer n-1 |

On CUDA, loads into the device are issued ``non_blocking`` on a dedicated stream and each
layer records an event, so the compute stream waits only for the layer it
reads. On the CPU they are plain copies done by the calling worker thread.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np
import torch

from kvstore.layout import KVLayout


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy ``src`` into ``dst`` (same size); returns ``dst``.

    CPU to CPU goes through numpy: one plain memcpy on the calling thread.
    ``torch.Tensor.copy_`` splits even a 64 KiB copy over its intra-op thread
    pool, which stalls badly when several processes share a few cores (a
    daemon and its engines): measured 15x slower, and up to 1000x in bursts
    on a loaded 2-core machine. Anything involving a GPU uses ``copy_`` on the
    current stream: asynchronous into the device (the loader orders readers with
    :class:`LayerSync`), synchronous into host memory, because every caller
    reads a host destination on the CPU right away (a disk write, a published
    host slot) and an asynchronous copy into pinned memory would not be done yet.
    """
    if dst.device.type == "cpu" and src.device.type == "cpu":
        np.copyto(dst.numpy(), src.numpy())
    else:
        dst.copy_(src, non_blocking=dst.device.type != "cpu")
    return dst


def layer_bytes(layout: KVLayout) -> int:
    """Bytes of one layer of one block (K and V)."""
    return layout.bytes_per_block // layout.num_layers


def copy_layer(layout: KVLayout, dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor], layer: int) -> None:
    """Copy layer ``layer`` of each source block (flat uint8) into the same layer of its destination."""
    lb = layer_bytes(layout)
    lo, hi = layer * lb, (layer + 1) * lb
    for dst, src in zip(dsts, srcs):
        copy_bytes(dst[lo:hi], src[lo:hi])


def copy_blocks(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """Copy whole blocks (flat uint8 tensors of equal size)."""
    for dst, src in zip(dsts, srcs):
        copy_bytes(dst, src)


def staging_buffer(layout: KVLayout, pin: bool) -> torch.Tensor:
    """A host buffer of one block, pinned when ``pin`` and CUDA is available."""
    return staging_blocks(layout, 1, pin)[0]


def staging_blocks(layout: KVLayout, n: int, pin: bool) -> torch.Tensor:
    """Host buffers of ``n`` blocks, ``[n, bytes_per_block]`` (row ``i`` is one block), in one allocation
    pinned when ``pin`` and CUDA is available: a batch pays one ``cudaHostAlloc``, not one per block."""
    buf = torch.empty((n, layout.bytes_per_block), dtype=torch.uint8)
    if pin and torch.cuda.is_available():
        buf = buf.pin_memory()
    return buf


class StreamEvents(Protocol):
    """How :class:`LayerSync` orders the compute stream after a copy stream (CUDA events by default)."""

    def record(self, stream: torch.cuda.Stream) -> object:
        """An event recorded on ``stream`` now (after the copies issued so far)."""
        ...

    def wait(self, event: object) -> None:
        """Make the current (compute) stream wait for ``event``."""
        ...


class CudaStreamEvents:
    """:class:`StreamEvents` with ``torch.cuda.Event``."""

    def record(self, stream: torch.cuda.Stream) -> object:
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, event: object) -> None:
        assert isinstance(event, torch.cuda.Event)
        torch.cuda.current_stream().wait_event(event)


class CopyStreams(StreamEvents, Protocol):
    """Side streams for asynchronous copies into the device, and the events that order readers after them.

    The loader issues a transfer's copies on :meth:`new_stream` inside
    :meth:`use`, lets :class:`LayerSync` record one event per layer, and calls
    :meth:`synchronize` before it gives back the host buffers the copies read
    (an asynchronous copy may still be reading them). CUDA by default
    (:class:`CudaCopyStreams`); tests pass a fake to run this path on the CPU.
    """

    def new_stream(self) -> torch.cuda.Stream:
        """A stream for one transfer."""
        ...

    def use(self, stream: torch.cuda.Stream) -> AbstractContextManager[object]:
        """Make ``stream`` the current stream inside the ``with`` block (copies are issued on it)."""
        ...

    def synchronize(self, stream: torch.cuda.Stream) -> None:
        """Block the calling thread until every copy issued on ``stream`` has finished."""
        ...


class CudaCopyStreams(CudaStreamEvents):
    """:class:`CopyStreams` with ``torch.cuda.Stream``."""

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream()

    def use(self, stream: torch.cuda.Stream) -> AbstractContextManager[object]:
        return torch.cuda.stream(stream)

    def synchronize(self, stream: torch.cuda.Stream) -> None:
        stream.synchronize()


def default_copy_streams(device: torch.device) -> CopyStreams | None:
    """CUDA streams for a pool on a CUDA device; ``None`` (plain synchronous copies) otherwise."""
    return CudaCopyStreams() if device.type == "cuda" else None


class LayerSync:
    """Per-layer readiness of a multi-layer transfer: thread events, plus stream events for asynchronous copies.

    ``events`` is ``None`` for a transfer done by plain copies on the calling
    thread (the CPU): a layer is usable once marked. Otherwise (the copy
    streams of a CUDA transfer, or a fake in tests) each layer marked with a
    stream records an event, and :meth:`wait` makes the compute stream wait for it.
    """

    def __init__(self, num_layers: int, events: StreamEvents | None = None) -> None:
        self._events = events
        self._host_events = [threading.Event() for _ in range(num_layers)]
        self._stream_events: list[object | None] = [None] * num_layers

    @property
    def on_streams(self) -> bool:
        """Whether marks record stream events (an asynchronous transfer)."""
        return self._events is not None

    def mark(self, layer: int, stream: torch.cuda.Stream | None = None) -> None:
        """Layer ``layer`` has been issued on ``stream`` (asynchronous) or copied (plain copies)."""
        if self._events is not None and stream is not None:
            self._stream_events[layer] = self._events.record(stream)
        self._host_events[layer].set()

    def mark_all(self) -> None:
        """Every layer is ready (used when a transfer ends early or had nothing to copy)."""
        for ev in self._host_events:
            ev.set()

    def wait(self, layer: int, timeout: float | None = None) -> bool:
        """Block until layer ``layer`` is usable by the compute stream; returns False on timeout."""
        if not self._host_events[layer].wait(timeout):
            return False
        ev = self._stream_events[layer]
        if ev is not None:
            assert self._events is not None
            self._events.wait(ev)
        return True

    def is_set(self, layer: int) -> bool:
        """Whether layer ``layer`` was marked."""
        return self._host_events[layer].is_set()
