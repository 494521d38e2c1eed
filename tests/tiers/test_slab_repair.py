"""``kvstore repair`` for the slab tier: a damaged slab.path is moved aside untouched, the next start is empty,
and ``--salvage`` copies exactly the blocks that still verify (a flipped byte, a slot cut off by truncation and
an index entry that is lost stay behind, counted); refused while the tier is open."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
import yaml
from tiers_testlib import BIG, fail_puts_after_first, empty_blocks, make_blocks, make_keys

from kvstore.cli.main import main
from kvstore.errors import TierError
from kvstore.tiers.slab.tier import SlabTier

N = 24
SLOTS = 320
MANY = 300
"""Blocks whose index spans several leaf pages (about 70 entries per 4 KiB page)."""


def _open(path: Path) -> SlabTier:
    return SlabTier(BIG, path, SLOTS * _SIZE)


def _filled(path: Path, n: int = N) -> tuple[list[bytes], list[torch.Tensor], dict[bytes, int]]:
    tier = _open(path)
    keys, blocks = make_keys(BIG, n), make_blocks(BIG, n, seed=1)
    assert tier.put(keys, blocks) == [True] * n
    slots = {k: tier._slots[k] for k in keys}  # noqa: SLF001 - the test damages chosen slots
    tier.close()
    return keys, blocks, slots


def _config(tmp_path: Path, slab: Path, tiers: list[str] | None = None) -> Path:
    model = {"model_id": BIG.model_id, "num_layers": BIG.num_layers, "num_kv_heads": BIG.num_kv_heads,
             "head_dim": BIG.head_dim, "block_size": BIG.block_size, "dtype": "float16"}
    body = {"model": model, "tiers": tiers or ["host", "slab"],
            "slab": {"path": str(slab), "max_size": SLOTS * _SIZE}}
    path = tmp_path / "kv.yaml"
    path.write_text(yaml.safe_dump(body))
    return path


def _digests(path: Path) -> dict[str, str]:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file() and p.name != "kvstore.lock"}


_SIZE = 0


@pytest.fixture(autouse=True, scope="module")
def _slot_bytes(tmp_path_factory: pytest.TempPathFactory) -> None:
    global _SIZE  # noqa: PLW0603 - one probe per module: the slot size of BIG
    tier = SlabTier(BIG, tmp_path_factory.mktemp("probe"), 1 << 30)
    _SIZE = tier.slot_size
    tier.close()


def test_a_garbage_index_is_moved_aside_untouched_and_the_tier_starts_empty(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slab = tmp_path / "slab"
    _filled(slab)
    (slab / "index" / "data.mdb").write_bytes(b"garbage" * 2000)  # the tier now refuses to open
    with pytest.raises(TierError, match=r"kvstore repair --config"):
        _open(slab)
    before = _digests(slab)
    assert main(["repair", "--config", str(_config(tmp_path, slab)), "--salvage"]) == 0
    out = capsys.readouterr().out
    [moved] = [p for p in tmp_path.iterdir() if p.name.startswith("slab.damaged-")]
    assert f"moved {slab} (slab.path) aside to {moved} (kept for inspection)" in out
    assert _digests(moved) == before and not (moved / "salvage-scratch").exists()  # kept as it was
    # Which key owns which slot is lost with the index: nothing can be salvaged, and the note says why.
    assert "salvaged 0 blocks" in out and "note: " in out and "index" in out
    tier = _open(slab)
    assert tier.stats().num_blocks == 0
    tier.close()


def test_salvage_after_slot_damage_serves_the_rest_bit_identical(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    slab = tmp_path / "slab"
    keys, blocks, slots = _filled(slab)
    flipped, cut = keys[3], max(keys, key=lambda k: slots[k])
    with open(slab / "slots.dat", "r+b") as f:
        f.seek(slots[flipped] * _SIZE + 200)
        byte = f.read(1)
        f.seek(slots[flipped] * _SIZE + 200)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.truncate(slab / "slots.dat", slots[cut] * _SIZE + 100)
    assert main(["repair", "--config", str(_config(tmp_path, slab)), "--salvage"]) == 0
    out = capsys.readouterr().out
    assert f"salvaged {N - 2} blocks" in out and "2 could not be read or failed verification" in out
    tier = _open(slab)
    dests = empty_blocks(BIG, N)
    found = tier.get(keys, dests)
    assert found == [k not in (flipped, cut) for k in keys]
    assert all(torch.equal(dests[i], blocks[i]) for i in range(N) if found[i])
    assert tier.stats().corrupt_dropped == 0
    tier.close()


def test_salvage_from_a_truncated_index_keeps_what_it_still_names(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    slab = tmp_path / "slab"
    keys, blocks, _ = _filled(slab, MANY)
    data = slab / "index" / "data.mdb"
    os.truncate(data, os.path.getsize(data) // 2)  # the leaf pages past the cut read as zeros (LMDB aborts there)
    assert main(["repair", "--config", str(_config(tmp_path, slab)), "--salvage"]) == 0
    out = capsys.readouterr().out
    assert "stopped at a damaged page" in out  # the walk's child died, the repair did not
    tier = _open(slab)
    dests = empty_blocks(BIG, MANY)
    found = tier.get(keys, dests)
    assert all(torch.equal(dests[i], blocks[i]) for i in range(MANY) if found[i])  # never a wrong block
    assert 0 < sum(found) < MANY and f"salvaged {sum(found)} blocks" in out
    tier.close()


def test_repair_of_the_slab_tier_is_refused_while_it_is_open(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    slab = tmp_path / "slab"
    tier = _open(slab)
    assert main(["repair", "--config", str(_config(tmp_path, slab))]) == 1
    assert f"slab.path {slab} is in use by another kvstore process, pid {os.getpid()}" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir() if "damaged" in p.name] == []
    tier.close()
    assert main(["repair", "--config", str(_config(tmp_path, slab))]) == 0
    assert "the next start creates an empty" in capsys.readouterr().out
    assert main(["repair", "--config", str(_config(tmp_path, slab))]) == 0
    assert "nothing at slab.path" in capsys.readouterr().out


def test_tier_flag_chooses_the_disk_tier_to_repair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    slab = tmp_path / "slab"
    _filled(slab)
    config = _config(tmp_path, slab, tiers=["host", "lmdb"])  # the config names lmdb: --tier slab overrides
    assert main(["repair", "--config", str(config), "--tier", "slab"]) == 0
    assert "(slab.path) aside" in capsys.readouterr().out and not slab.exists()


def test_a_salvage_that_runs_out_of_disk_says_where_everything_is(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    slab = tmp_path / "slab"
    keys, blocks, _ = _filled(slab, MANY)
    before = _digests(slab)
    real_put = SlabTier.put
    calls = fail_puts_after_first(monkeypatch, SlabTier, lambda t: f"write to slab data file {t.data.path} failed: No space left on device")
    assert main(["repair", "--config", str(_config(tmp_path, slab)), "--salvage"]) == 1
    err = capsys.readouterr().err
    [moved] = [p for p in tmp_path.iterdir() if p.name.startswith("slab.damaged-")]
    assert "salvage stopped: write to slab data file" in err and "No space left on device" in err
    assert f"kept untouched at {moved}; slab.path {slab} holds the {calls[0]} blocks salvaged before that" in err
    assert _digests(moved) == before
    monkeypatch.setattr(SlabTier, "put", real_put)
    tier = _open(slab)
    dests = empty_blocks(BIG, MANY)
    found = tier.get(keys, dests)
    assert sum(found) == calls[0] and all(torch.equal(dests[i], blocks[i]) for i in range(MANY) if found[i])
    tier.close()
