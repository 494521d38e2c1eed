"""Damaged LMDB files: refused with a TierError naming the file and `kvstore repair` (never a
SIGBUS or a raw lmdb traceback), one unreadable block is a counted miss, and `kvstore repair` starts afresh."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import lmdb
import pytest
import torch
import yaml
from tiers_testlib import BIG, fail_puts_after_first, damage_leaf_of, empty_blocks, make_blocks, make_keys

from kvstore.cli.main import main
from kvstore.errors import TierError
from kvstore.tiers import DiskTier

HERE = str(Path(__file__).parent)
N = 300  # several leaf pages of keys, so damage to one leaves the others readable


def filled(path: Path) -> tuple[list[bytes], list[torch.Tensor]]:
    """An environment at ``path`` holding N BIG blocks (values on overflow pages, as real blocks)."""
    keys, blocks = make_keys(BIG, N), make_blocks(BIG, N, seed=1)
    tier = DiskTier(BIG, path, 16 << 20)
    for i in range(0, N, 50):
        assert tier.put(keys[i : i + 50], blocks[i : i + 50]) == [True] * 50
    tier.close()
    return keys, blocks


_OPEN = """
import sys
sys.path.insert(0, sys.argv[2])
from tiers_testlib import BIG, empty_blocks, make_keys
from kvstore.errors import TierError
from kvstore.tiers import DiskTier
try:
    tier = DiskTier(BIG, sys.argv[1], 16 << 20)
except TierError as exc:
    print(exc, file=sys.stderr)
    sys.exit(3)
print(sum(tier.get(make_keys(BIG, 300), empty_blocks(BIG, 300))))
"""


def test_truncated_data_mdb_is_refused_cleanly_not_sigbus(tmp_path: Path) -> None:
    filled(tmp_path)
    data = tmp_path / "data.mdb"
    full = data.stat().st_size
    os.truncate(data, full // 2)
    res = subprocess.run([sys.executable, "-c", _OPEN, str(tmp_path), HERE], capture_output=True, text=True, timeout=120)
    assert res.returncode == 3, f"exit {res.returncode} (a negative code is a signal): {res.stderr[-2000:]}"
    assert f"LMDB environment {data} is truncated: {full // 2} bytes, its meta page says {full}" in res.stderr
    assert "kvstore repair --config" in res.stderr and f"{tmp_path}.damaged-" in res.stderr
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("content", ["random", "short", "one meta page", "empty"])
def test_garbage_data_mdb_is_refused_naming_the_file(tmp_path: Path, content: str,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    if content == "one meta page":
        filled(tmp_path)
        os.truncate(tmp_path / "data.mdb", 4096)
    else:
        (tmp_path / "data.mdb").write_bytes({"random": os.urandom(64 << 10), "short": b"not lmdb", "empty": b""}[content])
    if content == "empty":  # a crash while LMDB created it, or a file cut to nothing: a new environment, said aloud
        with caplog.at_level("WARNING", logger="kvstore.tiers.lmdb.env"):
            DiskTier(BIG, tmp_path, 16 << 20).close()
        assert f"LMDB data file {tmp_path / 'data.mdb'} is empty (0 bytes)" in caplog.text
        return
    with pytest.raises(TierError) as info:
        DiskTier(BIG, tmp_path, 16 << 20)
    expected = {"random": "is not an LMDB data file", "short": "is not an LMDB data file",
                "one meta page": "is truncated: 4096 bytes, shorter than its two meta pages (8192 bytes)"}[content]
    assert f"LMDB environment {tmp_path / 'data.mdb'} {expected}" in str(info.value)
    assert "kvstore repair" in str(info.value)
    DiskTier(BIG, tmp_path / "elsewhere", 16 << 20).close()  # the refused open released its lock and nothing leaked


def test_a_directory_in_place_of_data_mdb_is_refused_naming_it(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "lmdb" / "data.mdb").mkdir(parents=True)
    with pytest.raises(TierError) as info:
        DiskTier(BIG, tmp_path / "lmdb", 16 << 20)
    assert f"LMDB environment {tmp_path / 'lmdb' / 'data.mdb'} is a directory" in str(info.value)
    assert "kvstore repair" in str(info.value)
    config = tmp_path / "kv.yaml"
    config.write_text(yaml.safe_dump({"model": {"model_id": "t", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8,
                                                "block_size": 4, "dtype": "float16"},
                                      "disk": {"path": str(tmp_path / "lmdb")}}))
    assert main(["repair", "--config", str(config), "--salvage"]) == 0  # moved aside, salvage says why: no traceback
    out = capsys.readouterr()
    assert "is a directory" in out.out + out.err and "Traceback" not in out.out + out.err


def test_lmdb_error_at_open_becomes_tier_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object, **kwargs: object) -> None:
        raise lmdb.CorruptedError("mdb_env_open: MDB_CORRUPTED: Located page was wrong type")

    monkeypatch.setattr(lmdb, "open", broken)
    with pytest.raises(TierError, match=r"LMDB environment .*data.mdb cannot be opened \(mdb_env_open: MDB_CORRUPTED.*kvstore repair"):
        DiskTier(BIG, tmp_path, 16 << 20)


def test_data_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "lmdb").write_text("x")
    with pytest.raises(TierError, match=f"data directory {tmp_path / 'lmdb'} exists and is not a directory"):
        DiskTier(BIG, tmp_path / "lmdb", 16 << 20)


def test_read_only_data_directory_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory this user cannot write. As root, permission bits do not stop writes (and a read-only mount
    needs privileges a test should not use), so the kernel's EACCES is injected at the same system calls."""
    filled(tmp_path)
    if os.geteuid() != 0:
        os.chmod(tmp_path / "kvstore.lock", 0o400)
        os.chmod(tmp_path, 0o500)
    else:
        real_open = os.open

        def no_write(path: str, flags: int, mode: int = 0o777, **kw: object) -> int:
            if str(path).startswith(str(tmp_path)) and flags & (os.O_RDWR | os.O_WRONLY):
                raise PermissionError(errno.EACCES, "Permission denied", path)
            return real_open(path, flags, mode, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(os, "open", no_write)
    try:
        with pytest.raises(TierError, match=f"cannot create the lock file {tmp_path}/kvstore.lock: Permission denied "
                           f"\\(is disk.path {tmp_path} writable by this user\\?\\)"):
            DiskTier(BIG, tmp_path, 16 << 20)
    finally:
        os.chmod(tmp_path, 0o700)
    monkeypatch.undo()

    def read_only(*args: object, **kwargs: object) -> None:  # the lock file writable, LMDB's files not
        raise lmdb.ReadonlyError(f"{tmp_path}: Permission denied")

    monkeypatch.setattr(lmdb, "open", read_only)
    with pytest.raises(TierError, match=f"cannot be opened for writing .*make disk.path {tmp_path} and its files writable"):
        DiskTier(BIG, tmp_path, 16 << 20)


def test_unreadable_page_makes_its_blocks_counted_misses_not_exceptions(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys, blocks = filled(tmp_path)
    first = keys.index(min(keys))  # damage the first leaf (in key order): a key sorting last is elsewhere
    assert damage_leaf_of(str(tmp_path / "data.mdb"), keys[first]) >= 1
    tier = DiskTier(BIG, tmp_path, 16 << 20)
    dests = empty_blocks(BIG, N)
    found = tier.get(keys, dests)
    lost = found.count(False)
    assert 0 < lost < N and not found[first]
    assert all(torch.equal(dests[i], blocks[i]) for i in range(N) if found[i])
    s = tier.stats()
    assert (s.hits, s.misses, s.read_errors, s.corrupt_dropped) == (N - lost, lost, lost, 0)
    assert "is unreadable (mdb_cursor_get: MDB_CORRUPTED" in caplog.text and "kvstore repair" in caplog.text
    assert tier.contains_prefix(keys) == found.index(False)  # the prefix ends at the damage, without raising
    assert tier.put([b"\xff" * 32], blocks[:1]) == [True]  # the rest of the tier keeps working
    with pytest.raises(TierError, match=r"data.mdb is damaged \(mdb_put: MDB_CORRUPTED.*kvstore repair"):
        tier.put([b"\x00" * 32], blocks[:1])  # a write through the damaged page: a clear error, not lmdb's
    tier.flush()
    tier.close()


def _config(tmp_path: Path, disk: Path) -> Path:
    model = {"model_id": BIG.model_id, "num_layers": BIG.num_layers, "num_kv_heads": BIG.num_kv_heads,
             "head_dim": BIG.head_dim, "block_size": BIG.block_size, "dtype": "float16"}
    path = tmp_path / "kv.yaml"
    path.write_text(yaml.safe_dump({"model": model, "disk": {"path": str(disk), "max_size": "16MiB"}}))
    return path


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_repair_moves_a_truncated_environment_aside_and_starts_fresh(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    disk = tmp_path / "lmdb"
    filled(disk)
    os.truncate(disk / "data.mdb", 100_000)
    before = _digest(disk / "data.mdb")
    config = _config(tmp_path, disk)
    assert main(["repair", "--config", str(config), "--salvage"]) == 0
    out = capsys.readouterr().out
    [moved] = [p for p in tmp_path.iterdir() if p.name.startswith("lmdb.damaged-")]
    assert f"moved {disk} (disk.path) aside to {moved} (kept for inspection)" in out
    assert _digest(moved / "data.mdb") == before and not (moved / "salvage-scratch").exists()  # kept as it was
    assert "salvaged" in out and "could not be read or failed verification" in out
    tier = DiskTier(BIG, disk, 16 << 20)  # opens again, with whatever verified (the file was cut short)
    keys, blocks = make_keys(BIG, N), make_blocks(BIG, N, seed=1)
    dests = empty_blocks(BIG, N)
    found = tier.get(keys, dests)
    assert all(torch.equal(dests[i], blocks[i]) for i in range(N) if found[i])
    tier.close()


def test_repair_salvages_every_readable_block_bit_identical(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    disk = tmp_path / "lmdb"
    keys, blocks = filled(disk)
    damage_leaf_of(str(disk / "data.mdb"), min(keys))
    probe = DiskTier(BIG, disk, 16 << 20)
    readable = probe.get(keys, empty_blocks(BIG, N))
    probe.close()
    assert main(["repair", "--config", str(_config(tmp_path, disk)), "--salvage"]) == 0
    out = capsys.readouterr().out
    tier = DiskTier(BIG, disk, 16 << 20)
    dests = empty_blocks(BIG, N)
    found = tier.get(keys, dests)
    assert all(torch.equal(dests[i], blocks[i]) for i in range(N) if found[i])
    assert found == readable and 0 < sum(found) < N  # exactly what the damaged environment could still serve
    assert f"salvaged {sum(found)} blocks" in out and f"{N - sum(found)} could not be read" in out
    assert tier.stats().read_errors == 0
    tier.close()


def test_repair_is_refused_while_the_environment_is_open(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    disk = tmp_path / "lmdb"
    tier = DiskTier(BIG, disk, 16 << 20)
    assert main(["repair", "--config", str(_config(tmp_path, disk))]) == 1
    assert f"disk.path {disk} is in use by another kvstore process, pid {os.getpid()}" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir() if "damaged" in p.name] == []
    tier.close()
    assert main(["repair", "--config", str(_config(tmp_path, disk))]) == 0
    assert "the next start creates an empty" in capsys.readouterr().out


def test_repair_help() -> None:
    res = subprocess.run([sys.executable, "-m", "kvstore", "repair", "--help"], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "--salvage" in res.stdout and ".damaged-" in res.stdout


def test_a_salvage_that_runs_out_of_disk_says_where_everything_is(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    disk = tmp_path / "lmdb"
    keys, blocks = filled(disk)
    os.truncate(disk / "data.mdb", os.path.getsize(disk / "data.mdb") - 4096)  # damaged: repair refuses to open it as is
    before = _digest(disk / "data.mdb")
    real_put = DiskTier.put
    calls = fail_puts_after_first(monkeypatch, DiskTier, lambda t: f"write to LMDB environment {t.path} failed: No space left on device")
    assert main(["repair", "--config", str(_config(tmp_path, disk)), "--salvage"]) == 1
    err = capsys.readouterr().err
    [moved] = [p for p in tmp_path.iterdir() if p.name.startswith("lmdb.damaged-")]
    assert "salvage stopped: write to LMDB environment" in err and "No space left on device" in err
    assert f"kept untouched at {moved}; disk.path {disk} holds the {calls[0]} blocks salvaged before that" in err
    assert _digest(moved / "data.mdb") == before  # the damaged original is as it was, for another try
    monkeypatch.setattr(DiskTier, "put", real_put)
    tier = DiskTier(BIG, disk, 16 << 20)  # the fresh tier opens with the first batch, every block verified
    dests = empty_blocks(BIG, N)
    found = tier.get(keys, dests)
    assert sum(found) == calls[0] and all(torch.equal(dests[i], blocks[i]) for i in range(N) if found[i])
    tier.close()
