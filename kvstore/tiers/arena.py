"""The host tier's memory: one preallocated range of slots, plain, pinned and/or shared.

::

    tensor  [ slot 0 | slot 1 | ... | slot num_slots-1 ]   each bytes_per_block bytes

Pinning uses ``cudaHostRegister`` on memory we allocated ourselves rather
than ``Tensor.pin_memory()``: torch's caching host allocator keeps pinned
blocks after they are freed, which is how pinned memory "leaks" in long-lived
servers. Registering our own range lets :meth:`HostArena.close` unregister it
deterministically, and it works the same for a POSIX shared-memory segment.

Shared memory: the owner creates the segment (mode 0600: only the owner's
user can map it) and unlinks it on close; other processes
:meth:`HostArena.attach` by name. The owner holds an exclusive ``flock`` on
the segment for its life, which is how a segment is proven stale: the kernel
drops the lock when the owner exits (even by ``kill -9``), so
:meth:`HostArena.remove_stale` unlinks a segment only if it can take that lock,
and otherwise refuses, naming the owner's pid. A second daemon configured
with the same ``host.shm_name`` therefore never deletes a live daemon's
segment (whose clients would then read another arena's bytes). Python < 3.13 registers every
attached segment with the attaching process's resource tracker, which unlinks
it when that process exits (destroying the owner's cache), so attachers
unregister it immediately.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import sys
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import _posixshmem  # type: ignore[import-not-found]  # no stubs; the module SharedMemory itself uses (POSIX only, like the daemon)
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Literal

import torch

from kvstore.errors import TierError
from kvstore.tiers.prefault import Prefaulter
from kvstore.tiers.datadir import FILE_MODE, describe_process, flock_holder

PinMode = Literal["auto", "always", "never"]


def resolve_pin(mode: PinMode) -> bool:
    """Whether to pin under ``mode``; ``always`` without CUDA raises :class:`TierError`."""
    if mode == "never":
        return False
    available = torch.cuda.is_available()
    if mode == "always" and not available:
        raise TierError("host.pin_memory is 'always' but CUDA is not available; use 'auto' or 'never'")
    return available


def _own(shm: SharedMemory) -> None:
    """Make the just-created ``shm`` provably ours: mode 0600 and an exclusive ``flock`` held while it is open.

    A :meth:`HostArena.remove_stale` running between our create and our lock could have unlinked it (and a
    third process created a new one under the name); then the name no longer leads to our segment, and
    we refuse rather than serve an arena no client can reach."""
    fd = shm._fd  # type: ignore[attr-defined]
    os.fchmod(fd, FILE_MODE)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        ours = os.fstat(fd)
        probe = _posixshmem.shm_open("/" + shm.name, os.O_RDONLY, 0)
        try:
            same = os.fstat(probe).st_ino == ours.st_ino
        finally:
            os.close(probe)
    except OSError:
        same = False
    if not same:
        shm.close()
        raise TierError(f"shared memory segment {shm.name!r} was claimed by another process while this one created "
                        "it; two daemons are starting with the same host.shm_name")


class HostArena:
    """``num_slots`` slots of ``bytes_per_block`` bytes, as one flat ``uint8`` tensor.

    Build with :meth:`allocate` (private or owned shared memory) or
    :meth:`attach` (another process's shared memory).
    """

    def __init__(self, tensor: torch.Tensor, bytes_per_block: int, shm: SharedMemory | None, owner: bool,
                 num_slots: int | None = None) -> None:
        self.bytes_per_block = bytes_per_block
        self.num_slots = tensor.numel() // bytes_per_block if num_slots is None else num_slots
        self.tensor: torch.Tensor | None = tensor[: self.num_slots * bytes_per_block]
        self.tail: torch.Tensor | None = None
        """A shared segment's bytes after the slots (the slot directory, :mod:`kvstore.tiers.slot_directory`)."""
        if shm is not None and num_slots is not None:
            self.tail = tensor[num_slots * bytes_per_block :]
        self._shm = shm
        self._owner = owner
        self.pinned = False
        self._prefaulter: Prefaulter | None = None

    # ------------------------------------------------------------ building
    @classmethod
    def allocate(
        cls, num_slots: int, bytes_per_block: int, *, pin: bool, shm_name: str | None = None, shared: bool = False,
        tail_bytes: int = 0,
    ) -> HostArena:
        """New memory for ``num_slots`` slots; ``shared`` creates the segment ``shm_name`` (random name if None)
        with ``tail_bytes`` more after the slots (:attr:`tail`).

        Raises :class:`TierError` if the segment already exists or pinning fails.
        """
        if num_slots < 1:
            raise TierError(f"host arena needs at least one slot of {bytes_per_block} bytes")
        nbytes = num_slots * bytes_per_block
        shm = None
        if shared:
            try:
                shm = SharedMemory(name=shm_name, create=True, size=nbytes + tail_bytes)
            except FileExistsError:
                raise TierError(f"shared memory segment {shm_name!r} already exists (another daemon, or a stale one)") from None
            _own(shm)
            tensor = torch.frombuffer(shm.buf, dtype=torch.uint8)
        else:
            tensor = torch.empty(nbytes, dtype=torch.uint8)
        arena = cls(tensor, bytes_per_block, shm, owner=True, num_slots=num_slots)
        if pin:
            arena._pin()
        return arena

    @staticmethod
    def remove_stale(name: str) -> bool:
        """Unlink the segment ``name`` if its owner is gone; ``False`` if there is no such segment.

        Raises :class:`TierError` naming the owner if a live process holds the segment's lock.
        """
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise TierError(f"cannot open shared memory segment {name!r} to check its owner: {exc.strerror or exc}") from None
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise TierError(
                    f"shared memory segment {name!r} belongs to a running daemon, {describe_process(flock_holder(fd))}; "
                    "stop it, or give this daemon another host.shm_name (or daemon.socket_path, from which the "
                    "default name derives)"
                ) from None
            _posixshmem.shm_unlink("/" + name)  # still locked by us: no new owner can have claimed it meanwhile
            return True
        finally:
            os.close(fd)

    @classmethod
    def attach(cls, name: str, bytes_per_block: int, *, pin: bool = False, num_slots: int | None = None) -> HostArena:
        """Map the existing segment ``name`` read-write; closing it never unlinks the segment.

        ``num_slots``: how many slots the owner made (what its daemon said at login); the bytes after them are
        :attr:`tail`. ``None``: as many as fit. Raises :class:`TierError` when the segment is smaller."""
        try:
            if sys.version_info >= (3, 13):
                shm = SharedMemory(name=name, track=False)  # type: ignore[call-arg]
            else:
                shm = SharedMemory(name=name)
                resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
        except FileNotFoundError:
            raise TierError(f"no shared memory segment named {name!r}; is the daemon running?") from None
        if num_slots is not None and shm.size < num_slots * bytes_per_block:
            size = shm.size
            shm.close()
            raise TierError(f"shared memory segment {name!r} has {size} bytes, too few for {num_slots} slots of "
                            f"{bytes_per_block} bytes")
        arena = cls(torch.frombuffer(shm.buf, dtype=torch.uint8), bytes_per_block, shm, owner=False, num_slots=num_slots)
        if pin:
            arena._pin()
        return arena

    # ----------------------------------------------------------- accessors
    @property
    def name(self) -> str | None:
        """Name of the shared-memory segment (``None`` for private memory)."""
        return None if self._shm is None else self._shm.name

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
        """Map this process's pages of the slots in the background (:mod:`kvstore.tiers.prefault`); ``None``
        where there is nothing to do (pinned: registering populated them). :meth:`close` stops it first."""
        if self.tensor is None or self.pinned or self._prefaulter is not None:
            return None
        self._prefaulter = Prefaulter(self.tensor.data_ptr(), self.tensor.numel(), name)
        return self._prefaulter

    def close(self) -> None:
        """Unpin, unmap, and (owner only) unlink the segment. Idempotent; slot views must not be used after."""
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
            if self._owner:
                self._shm.unlink()
            try:
                self._shm.close()
            except BufferError:
                # A caller still holds a slot view. The mapping then lives until that view is
                # garbage collected (the view keeps the mmap alive); the name is already unlinked.
                pass
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
