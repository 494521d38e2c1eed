"""The host tier's memory: one preallocated range of slots, plain, pinned and/or shared.

::

    tensor  [ slot 0 | slot 1 | ... | slot num_slots-1 ]   each bytes_per_block bytes

Pinning uses ``cudaHostRegister`` on memory we allocated ourselves rather
than ``Tensor.pin_memory()``: torch's caching host allocator keeps pinned
blocks after they are freed, which is how pinned memory "leaks" in long-lived
servers. Registering our own range lets :meth:`HostArena.close` unregister it
deterministically, and it works the same for a POSIX shared-memory segment.

Shared memory: the owner creates a sealed ``memfd`` (:func:`os.memfd_create`),
not a named POSIX segment, and hands its descriptor to each client that logs
in (``SCM_RIGHTS`` over the daemon's Unix socket, :mod:`kvstore.daemon.server.session`).
Three consequences:

- nothing to find: the segment has no name under ``/dev/shm``, so only processes
  the daemon let in (and those that may ptrace it) can map it;
- nothing to shrink: its size is sealed (``F_SEAL_SHRINK | F_SEAL_GROW |
  F_SEAL_SEAL``), so an ``ftruncate`` by a client or any other process fails
  with ``EPERM`` instead of turning the daemon's next touch of a page into
  ``SIGBUS``; :meth:`HostArena.attach` refuses a descriptor without the seal;
- nothing stale: the kernel frees the memory with its last descriptor or
  mapping, so a daemon killed with ``kill -9`` leaves no segment behind, and
  two daemons can never claim the same one.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Literal

import torch

from kvstore.errors import TierError
from kvstore.tiers.host.prefault import Prefaulter

PinMode = Literal["auto", "always", "never"]


def resolve_pin(mode: PinMode) -> bool:
    """Whether to pin under ``mode``; ``always`` without CUDA raises :class:`TierError`."""
    if mode == "never":
        return False
    available = torch.cuda.is_available()
    if mode == "always" and not available:
        raise TierError("host.pin_memory is 'always' but CUDA is not available; use 'auto' or 'never'")
    return available


SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
"""The seals on a shared arena: its size can never change, and no one can lift that."""


def _sealed_memfd(label: str, nbytes: int) -> int:
    """A new anonymous shared-memory file of ``nbytes`` bytes (close-on-exec), its size sealed."""
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError as exc:
        os.close(fd)
        raise TierError(f"cannot create the sealed shared arena {label!r} of {nbytes} bytes: {exc}") from None
    return fd


class _Mapping:
    """One shared mapping of a memfd, and (owner only) the descriptor clients receive."""

    def __init__(self, label: str, fd: int | None, mapped: mmap.mmap) -> None:
        self.label, self.fd, self.map = label, fd, mapped

    def close(self) -> None:
        """Close the descriptor and unmap (a still-exported slot view keeps the mapping until it is gone)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        try:
            self.map.close()
        except BufferError:
            pass  # a caller still holds a slot view: the mapping lives until that view is collected


class HostArena:
    """``num_slots`` slots of ``bytes_per_block`` bytes, as one flat ``uint8`` tensor.

    Build with :meth:`allocate` (private or owned shared memory) or
    :meth:`attach` (another process's shared memory).
    """

    def __init__(self, tensor: torch.Tensor, bytes_per_block: int, shm: _Mapping | None,
                 num_slots: int | None = None) -> None:
        self.bytes_per_block = bytes_per_block
        self.num_slots = tensor.numel() // bytes_per_block if num_slots is None else num_slots
        self.tensor: torch.Tensor | None = tensor[: self.num_slots * bytes_per_block]
        self.tail: torch.Tensor | None = None
        """A shared segment's bytes after the slots (the slot directory, :mod:`kvstore.tiers.host.slot_directory`)."""
        if shm is not None and num_slots is not None:
            self.tail = tensor[num_slots * bytes_per_block :]
        self._shm = shm
        self.pinned = False
        self._prefaulter: Prefaulter | None = None

    # ------------------------------------------------------------ building
    @classmethod
    def allocate(
        cls, num_slots: int, bytes_per_block: int, *, pin: bool, label: str = "kvstore-host", shared: bool = False,
        tail_bytes: int = 0,
    ) -> HostArena:
        """New memory for ``num_slots`` slots; ``shared`` makes it a sealed memfd (``label`` names it in
        ``/proc/<pid>/maps`` and logs) with ``tail_bytes`` more after the slots (:attr:`tail`), whose
        descriptor (:attr:`fd`) other processes :meth:`attach`.

        Raises :class:`TierError` if the memory cannot be created or pinning fails.
        """
        if num_slots < 1:
            raise TierError(f"host arena needs at least one slot of {bytes_per_block} bytes")
        nbytes = num_slots * bytes_per_block
        shm = None
        if shared:
            fd = _sealed_memfd(label, nbytes + tail_bytes)
            shm = _Mapping(label, fd, mmap.mmap(fd, nbytes + tail_bytes))
            tensor = torch.frombuffer(shm.map, dtype=torch.uint8)
        else:
            tensor = torch.empty(nbytes, dtype=torch.uint8)
        arena = cls(tensor, bytes_per_block, shm, num_slots=num_slots)
        if pin:
            arena._pin()
        return arena

    @classmethod
    def attach(cls, fd: int, label: str, bytes_per_block: int, *, pin: bool = False,
               num_slots: int | None = None) -> HostArena:
        """Map another process's shared arena from its descriptor ``fd`` (closed here, mapped or not).

        ``num_slots``: how many slots the owner made (what its daemon said at login); the bytes after them are
        :attr:`tail`. ``None``: as many as fit. Raises :class:`TierError`, naming ``label``, when the
        descriptor is not a memfd whose size is sealed (another process could shrink it under this one's
        mapping: ``SIGBUS`` at the next copy) or is smaller than that."""
        try:
            try:
                seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            except OSError as exc:
                raise TierError(f"the shared arena {label!r} is not a sealable memfd ({exc.strerror})") from None
            if seals & fcntl.F_SEAL_SHRINK == 0:
                raise TierError(f"the shared arena {label!r} is not sealed against shrinking (seals {seals:#x}); "
                                "refusing to map memory another process could truncate")
            size = os.fstat(fd).st_size
            if num_slots is not None and size < num_slots * bytes_per_block:
                raise TierError(f"the shared arena {label!r} has {size} bytes, too few for {num_slots} slots of "
                                f"{bytes_per_block} bytes")
            mapped = mmap.mmap(fd, size)  # the mapping keeps the file; the descriptor is not needed after
        finally:
            os.close(fd)
        arena = cls(torch.frombuffer(mapped, dtype=torch.uint8), bytes_per_block, _Mapping(label, None, mapped),
                    num_slots=num_slots)
        if pin:
            arena._pin()
        return arena

    # ----------------------------------------------------------- accessors
    @property
    def name(self) -> str | None:
        """The shared arena's label (``None`` for private memory): how logs and ``/proc/<pid>/maps`` name it."""
        return None if self._shm is None else self._shm.label

    @property
    def fd(self) -> int | None:
        """The shared arena's descriptor, for the owner to pass to clients (``None``: private, or attached)."""
        return None if self._shm is None else self._shm.fd

    def slot_view(self, slot: int) -> torch.Tensor:
        """Zero-copy ``uint8`` view of one slot."""
        if self.tensor is None:
            raise TierError("host arena is closed")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        start = slot * self.bytes_per_block
        return self.tensor[start : start + self.bytes_per_block]

    def write_slots(self, slots: Sequence[int], src_addrs: Sequence[int]) -> None:
        """Copy ``bytes_per_block`` bytes from each address into its slot (``src_addrs`` from
        :func:`~kvstore.tiers.base.buffer_addresses`, whose tensors the caller holds meanwhile)."""
        memory, bpb = self._memory(slots), self.bytes_per_block  # held until the copies are done
        base = memory.data_ptr()
        for slot, src, n in copy_runs(slots, src_addrs, bpb):
            _memmove(base + slot * bpb, src, n * bpb)

    def read_slots(self, slots: Sequence[int], dest_addrs: Sequence[int]) -> None:
        """Copy each slot into the ``bytes_per_block`` bytes at its destination address (see :meth:`write_slots`)."""
        memory, bpb = self._memory(slots), self.bytes_per_block  # held until the copies are done
        base = memory.data_ptr()
        for slot, dest, n in copy_runs(slots, dest_addrs, bpb):
            _memmove(dest, base + slot * bpb, n * bpb)

    def release_slots(self, slots: Sequence[int]) -> None:
        """Give the pages wholly inside ``slots`` back to the kernel (they read as zeros until written again):
        freed slots then cost no memory, which a budget shared by several arenas counts on. Nothing for a
        pinned arena (the CUDA driver holds its pages)."""
        if self.tensor is None or self.pinned:
            return
        base, bpb, page = self.tensor.data_ptr(), self.bytes_per_block, mmap.PAGESIZE
        advice = _MADV_REMOVE if self._shm is not None else _MADV_DONTNEED  # a memfd's pages, or anonymous ones
        for slot in slots:
            start = base + slot * bpb
            lo, hi = -(-start // page) * page, (start + bpb) // page * page
            if hi > lo and _madvise(lo, hi - lo, advice) != 0:
                return  # not fatal: the pages stay, counted as free slots all the same

    def _memory(self, slots: Sequence[int]) -> torch.Tensor:
        """The arena's tensor, after checking every slot is in range. The copies run on raw addresses
        (one ``memmove`` per block, GIL released, no tensor or array object per block) while the caller
        holds this tensor: private memory is then not freed, and a shared segment stays mapped (its
        ``torch.frombuffer`` export keeps the mapping; :meth:`close` tolerates that), so a copy racing
        a close touches live memory, never freed memory."""
        if self.tensor is None:
            raise TierError("host arena is closed")
        if slots and not (0 <= min(slots) and max(slots) < self.num_slots):
            raise IndexError(f"slot out of range [0, {self.num_slots}): {min(slots)}..{max(slots)}")
        return self.tensor

    # ------------------------------------------------------------- pinning
    def _pin(self) -> None:
        assert self.tensor is not None
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(self.tensor.data_ptr(), self.tensor.numel(), 0)
        if int(err) != 0:
            raise TierError(f"cudaHostRegister of {self.tensor.numel()} bytes failed with CUDA error {int(err)}")
        self.pinned = True

    def prefault(self, name: str) -> Prefaulter | None:
        """Map this process's pages of the slots in the background (:mod:`kvstore.tiers.host.prefault`); ``None``
        where there is nothing to do (pinned: registering populated them). :meth:`close` stops it first."""
        if self.tensor is None or self.pinned or self._prefaulter is not None:
            return None
        self._prefaulter = Prefaulter(self.tensor.data_ptr(), self.tensor.numel(), name)
        return self._prefaulter

    def close(self) -> None:
        """Unpin and unmap (the kernel frees a shared arena with its last mapping and descriptor).
        Idempotent; slot views must not be used after."""
        if self._prefaulter is not None:
            self._prefaulter.stop()  # before the pages it maps go away
            self._prefaulter = None
        if self.tensor is None:
            return
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self.tensor = None
        self.tail = None
        if self._shm is not None:
            self._shm.close()
            self._shm = None


def copy_runs(slots: Sequence[int], addrs: Sequence[int], bytes_per_block: int) -> list[tuple[int, int, int]]:
    """``(first slot, first address, blocks)`` per run of consecutive slots whose addresses are consecutive too,
    so one ``memmove`` copies a whole run: a fresh tier hands out consecutive slots, and an engine's staging
    buffer is one contiguous range, so a batch is then a few large copies instead of one call per block."""
    runs: list[tuple[int, int, int]] = []
    if not slots:
        return runs
    start_slot, start_addr, n = slots[0], addrs[0], 1
    for slot, addr in zip(slots[1:], addrs[1:]):
        if slot == start_slot + n and addr == start_addr + n * bytes_per_block:
            n += 1
        else:
            runs.append((start_slot, start_addr, n))
            start_slot, start_addr, n = slot, addr, 1
    runs.append((start_slot, start_addr, n))
    return runs


_libc = ctypes.CDLL(None, use_errno=True)
_madvise = _libc.madvise
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_MADV_DONTNEED = 4
_MADV_REMOVE = 9
_memmove = ctypes.memmove
"""``memmove`` through ctypes: releases the GIL for the copy, so two copier threads run in parallel."""


PARALLEL_COPY_BYTES = 4 << 20
"""Batches of at least this many bytes are copied on two threads (one thread's memmove does not reach the
memory bandwidth)."""

SlotCopy = Callable[[Sequence[int], Sequence[int]], None]
"""An arena copy: :meth:`HostArena.read_slots` or :meth:`HostArena.write_slots`."""


def copy_split(copy: SlotCopy, slots: list[int], addrs: list[int], bytes_per_block: int,
               copier: Callable[[], Executor]) -> None:
    """``copy(slots, addrs)``; from :data:`PARALLEL_COPY_BYTES` on, half of it on ``copier()``'s thread while
    this thread copies the other half (the embedded host tier and the daemon's clients copy this way)."""
    if len(slots) > 1 and len(slots) * bytes_per_block >= PARALLEL_COPY_BYTES:
        half = len(slots) // 2
        other = copier().submit(copy, slots[half:], addrs[half:])
        copy(slots[:half], addrs[:half])
        other.result()
    else:
        copy(slots, addrs)
