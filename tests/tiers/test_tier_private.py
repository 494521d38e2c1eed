"""Data at rest is owner-only, and one process at a time owns a data directory or segment."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from tiers_testlib import LAYOUTS, make_blocks, make_keys

from kvstore.errors import TierError
from kvstore.tiers import DiskTier, FileTier, HostTier, SlabTier
from kvstore.tiers.host.arena import HostArena

L = LAYOUTS["float16"]
HERE = str(Path(__file__).parent)


def mode(path: Path | str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_lmdb_directory_0700_and_files_0600_even_when_found_wider(tmp_path: Path) -> None:
    root = tmp_path / "new" / "lmdb"
    tier = DiskTier(L, root, 8 << 20)
    tier.put(make_keys(L, 2), make_blocks(L, 2))
    tier.close()
    assert mode(tmp_path / "new") == 0o700 and mode(root) == 0o700
    assert {n: mode(root / n) for n in os.listdir(root)} == {"data.mdb": 0o600, "lock.mdb": 0o600, "kvstore.lock": 0o600}
    # What an older build left (0755 directory, 0644 files) is narrowed on open.
    os.chmod(root, 0o755)
    for name in os.listdir(root):
        os.chmod(root / name, 0o644)
    DiskTier(L, root, 8 << 20).close()
    assert mode(root) == 0o700 and all(mode(root / n) == 0o600 for n in os.listdir(root))


def test_file_tier_directories_0700_and_files_0600(tmp_path: Path) -> None:
    root = tmp_path / "files"
    tier = FileTier(L, root, 1 << 20)
    keys = make_keys(L, 2)
    tier.put(keys, make_blocks(L, 2))
    block = Path(tier.path_of(keys[0]))
    assert mode(root) == 0o700 and mode(block.parent) == 0o700 and mode(block) == 0o600
    tier.close()
    os.chmod(block, 0o644)
    os.chmod(block.parent, 0o755)
    FileTier(L, root, 1 << 20).close()
    assert mode(block) == 0o600 and mode(block.parent) == 0o700


def test_shared_memory_has_no_name_to_open() -> None:
    """The shared arena is an unnamed memfd: nothing in /dev/shm for another process to open, map or
    truncate; only a process handed its descriptor (a daemon's logged-in client) maps it."""
    before = set(os.listdir("/dev/shm"))
    tier = HostTier(L, 4 * L.bytes_per_block, pin_memory="never", shared_memory=True)
    try:
        assert set(os.listdir("/dev/shm")) == before
        assert tier.arena.fd is not None
        assert os.readlink(f"/proc/self/fd/{tier.arena.fd}") == "/memfd:kvstore-host (deleted)"
    finally:
        tier.close()


_OPEN = """
import sys
sys.path.insert(0, sys.argv[3])
from tiers_testlib import LAYOUTS
from kvstore.errors import TierError
from kvstore.tiers import DiskTier, FileTier, SlabTier
cls = {"lmdb": DiskTier, "file": FileTier, "slab": SlabTier}[sys.argv[1]]
try:
    tier = cls(LAYOUTS["float16"], sys.argv[2], 8 << 20)
except TierError as exc:
    print(exc, file=sys.stderr)
    sys.exit(3)
print("opened", flush=True)
if len(sys.argv) > 4:
    sys.stdin.read()  # hold the tier until killed
"""


@pytest.mark.parametrize("kind", ["lmdb", "file", "slab"])
def test_second_process_on_a_data_directory_is_refused_naming_the_holder(tmp_path: Path, kind: str) -> None:
    cls = {"lmdb": DiskTier, "file": FileTier, "slab": SlabTier}[kind]
    setting = {"lmdb": "disk.path", "file": "file.path", "slab": "slab.path"}[kind]
    tier = cls(L, tmp_path, 8 << 20)
    other = subprocess.run([sys.executable, "-c", _OPEN, kind, str(tmp_path), HERE], capture_output=True, text=True)
    assert other.returncode == 3, other.stderr
    assert f"{setting} {tmp_path} is in use by another kvstore process, pid {os.getpid()} (" in other.stderr
    with pytest.raises(TierError, match=f"pid {os.getpid()}"):  # a second instance in this process too
        cls(L, tmp_path, 8 << 20)
    tier.close()
    again = subprocess.run([sys.executable, "-c", _OPEN, kind, str(tmp_path), HERE], capture_output=True, text=True)
    assert again.returncode == 0 and again.stdout == "opened\n", again.stderr


def test_slab_directories_0700_and_files_0600(tmp_path: Path) -> None:
    old = os.umask(0o022)  # a permissive umask: the tier must not rely on it
    try:
        tier = SlabTier(L, tmp_path / "slab", 8 << 20)
        tier.put(make_keys(L, 2), make_blocks(L, 2))
        tier.flush()
        root = tmp_path / "slab"
        assert mode(root) == 0o700 and mode(root / "index") == 0o700
        assert {p.name: mode(p) for p in [*root.iterdir(), *(root / "index").iterdir()] if p.is_file()} == {
            "kvstore.lock": 0o600, "slots.dat": 0o600, "data.mdb": 0o600, "lock.mdb": 0o600}
        tier.close()
    finally:
        os.umask(old)


def test_lock_of_a_killed_process_does_not_block_a_restart(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", _OPEN, "lmdb", str(tmp_path), HERE, "hold"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline() == "opened\n"
    with pytest.raises(TierError, match=f"pid {holder.pid}"):
        DiskTier(L, tmp_path, 8 << 20)
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
    assert (tmp_path / "kvstore.lock").read_text() == f"{holder.pid}\n"  # the stale record is still there...
    DiskTier(L, tmp_path, 8 << 20).close()  # ...and does not matter: the kernel dropped the lock


_OWN_ARENA = """
import sys
from kvstore.tiers.host.arena import HostArena
arena = HostArena.allocate(2048, 32768, pin=False, shared=True)  # 64 MiB
arena.prefault("test").done.wait(30)
print("owned", flush=True)
sys.stdin.read()
"""


def _memfd_inodes(pid: int) -> set[int]:
    """Inodes of the memfds process ``pid`` holds open."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:"):
                out.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            pass
    return out


def _held_anywhere(inodes: set[int]) -> bool:
    """Whether any process still holds (a descriptor to) or maps one of these memfds."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.stat(f"/proc/{pid}/fd/{fd}").st_ino in inodes and \
                            os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:"):
                        return True
                except OSError:
                    pass
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    parts = line.split()
                    if len(parts) >= 6 and parts[5].startswith("/memfd:") and int(parts[4]) in inodes:
                        return True
        except OSError:
            pass  # exited meanwhile, or not ours to read
    return False


def _rss_shmem_kib(pid: int) -> int:
    line = next(x for x in open(f"/proc/{pid}/status") if x.startswith("RssShmem:"))
    return int(line.split()[1])


def test_an_owner_killed_with_kill_9_leaves_no_arena_behind() -> None:
    """A named segment outlived a ``kill -9``'d daemon (and needed a stale check that could be wrong); a
    memfd's memory goes with its last descriptor and mapping, whatever ended the process. Checked on the
    arena's own file (no process holds or maps it afterwards), not on the machine's shared memory, which
    other processes change meanwhile."""
    before = set(os.listdir("/dev/shm"))
    owner = subprocess.Popen([sys.executable, "-c", _OWN_ARENA], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        assert owner.stdout is not None and owner.stdout.readline() == "owned\n"
        assert _rss_shmem_kib(owner.pid) > 48 << 10  # the 64 MiB are in use, in a memfd
        arena = _memfd_inodes(owner.pid)
        assert arena and _held_anywhere(arena)
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
        assert not _held_anywhere(arena)  # nothing keeps its pages: the kernel freed them
        assert set(os.listdir("/dev/shm")) == before
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
