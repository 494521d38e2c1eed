"""One daemon for several models: ``daemon.layouts: any`` serves every KV layout its clients bring.

Each layout's tiers open on its first client (its host arena, its LMDB in a directory of its own); the
layouts share ``host.capacity`` and ``disk.max_size``; STATS and ``/metrics`` report each layout; a restarted
daemon finds a layout's blocks again; and a layout it cannot store is refused naming why.
"""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from daemonlib import cleanup, keys_for, layout_tier, put_layout, read_layout, short_tmpdir, start_daemon, write_config
from kvstore.cli.stats_cmd import format_stats
from kvstore.daemon.client.connection import DaemonClient
from kvstore.daemon.wire.frames import DaemonError, ErrorCode
from kvstore.daemon.server.layout_dirs import layout_dirname, layout_label
from kvstore.daemon.client.tier import DaemonTier
from kvstore.layout import KVLayout

SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16", model_id="small")  # 512 B
LARGE = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32", model_id="large")  # 4 KiB
HOST = 64 * 1024
"""Host bytes both layouts share: 128 small blocks, or 16 large ones."""


def _config(root: Path, **over: dict) -> Path:
    daemon = {"layouts": "any", **over.pop("daemon", {})}
    return write_config(root, daemon=daemon, host={"capacity": HOST, "prefault": False}, **over)


def _tier(d, layout: KVLayout, name: str = "test") -> DaemonTier:  # noqa: ANN001
    return layout_tier(d, layout, name)


_put, _read = put_layout, read_layout


def test_two_layouts_through_one_daemon_each_served_its_own_blocks_and_reported_apart() -> None:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(_config(root))
        small, large = _tier(d, SMALL, "small engine"), _tier(d, LARGE, "large engine")
        # the arenas are sparse (pages exist where slots are used): a client must not map them all ahead
        assert small.client.hello.sparse and large.client.hello.sparse  # type: ignore[union-attr]
        ks, kl = keys_for(20, seed=1), keys_for(6, seed=2)
        assert all(_put(small, SMALL, ks)) and all(_put(large, LARGE, kl))
        assert all(_read(small, SMALL, ks)) and all(_read(large, LARGE, kl))
        small.flush()
        large.flush()
        stats = small.client.stats()
        labels = {layout_label(SMALL), layout_label(LARGE)}
        assert set(stats["layouts"]) == labels and stats["daemon"]["layouts"] == "any"
        assert stats["layouts"][layout_label(SMALL)]["host"]["num_blocks"] == 20
        assert stats["layouts"][layout_label(LARGE)]["host"]["num_blocks"] == 6
        assert stats["host"]["num_blocks"] == 26 and stats["host"]["capacity_bytes"] == HOST  # summed, one budget
        text = format_stats(stats)  # `kvstore stats`: a line per layout, then the summed tiers
        assert "any layout, 2 of at most 8 open" in text
        assert f"layout {layout_label(SMALL)}: 512 bytes/block, host 20 blocks" in text
        assert layout_label(SMALL) == f"small|float16|4t@{SMALL.fingerprint.hex()[:8]}"  # model, dtype, block size
        verbose = format_stats(stats, verbose=True)  # `kvstore stats --verbose`: every field under each layout
        assert "block_size=4, dtype=float16, head_dim=8, model_id=small, num_kv_heads=2, num_layers=2" in verbose
        assert stats["host"]["used_bytes"] == 20 * SMALL.bytes_per_block + 6 * LARGE.bytes_per_block
        # each layout's disk data in a directory of its own
        assert {p.name for p in (root / "lmdb" / "layouts").iterdir()} == {layout_dirname(SMALL), layout_dirname(LARGE)}
        # /metrics: every storage sample names its layout, and the text parses
        text = urllib.request.urlopen(f"{d.metrics_url}/metrics", timeout=10).read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        blocks = {(s.labels["layout"], s.labels["tier"]): s.value for s in fams["kvstore_blocks"].samples}
        assert blocks[(layout_label(SMALL), "host")] == 20 and blocks[(layout_label(LARGE), "host")] == 6
        small.client.close()
        large.client.close()
        assert d.stop() == 0
    finally:
        cleanup(d, root)


def test_before_any_engine_comes_the_daemon_reports_no_layout() -> None:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(_config(root))
        observer = DaemonClient(None, socket_path=d.socket_path, client_name="stats", use_shm=False)
        observer.connect(5)
        stats = observer.stats()
        observer.close()
        assert stats["layouts"] == {} and "no layout open yet" in format_stats(stats)
        assert d.stop() == 0
    finally:
        cleanup(d, root)


def test_the_layouts_share_host_memory_the_one_in_use_takes_it_from_the_other() -> None:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(_config(root, tiers=["host"]))
        small, large = _tier(d, SMALL), _tier(d, LARGE)
        ks = keys_for(128, seed=3)  # the whole budget
        assert all(_put(small, SMALL, ks))
        kl = keys_for(12, seed=4)  # 48 KiB: most of the budget, taken from the small layout's blocks
        assert all(_put(large, LARGE, kl))
        assert all(_read(large, LARGE, kl))
        kept = sum(_read(small, SMALL, ks))
        assert kept <= (HOST - 12 * LARGE.bytes_per_block) // SMALL.bytes_per_block  # never more than the budget
        stats = small.client.stats()
        assert stats["host"]["used_bytes"] <= HOST
        assert stats["layouts"][layout_label(SMALL)]["host"]["evictions"] >= 128 - kept
        small.client.close()
        large.client.close()
        assert d.stop() == 0
    finally:
        cleanup(d, root)


def test_the_layouts_share_the_disk_the_one_in_use_takes_it_from_the_other() -> None:
    wide = KVLayout(num_layers=4, num_kv_heads=2, head_dim=32, block_size=4, dtype="float32", model_id="wide")  # 8 KiB
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(_config(root, disk={"max_size": "4MiB"}))
        first, large = _tier(d, wide), _tier(d, LARGE)
        kw = keys_for(500, seed=7)  # more than the whole disk budget
        for i in range(0, len(kw), 50):
            assert all(_put(first, wide, kw[i : i + 50]))
        first.flush()
        before = first.client.stats()
        limit = before["disk"]["capacity_bytes"]
        assert limit / 2 < before["disk"]["used_bytes"] <= limit
        kl = keys_for(300, seed=8)  # 300 blocks of 4 KiB (two LMDB pages each): most of the disk
        for i in range(0, len(kl), 50):
            assert all(_put(large, LARGE, kl[i : i + 50]))
        large.flush()
        after = large.client.stats()
        assert after["disk"]["used_bytes"] <= limit  # the two environments together
        assert after["layouts"][layout_label(LARGE)]["disk"]["num_blocks"] == 300  # taken from the idle layout
        assert (after["layouts"][layout_label(wide)]["disk"]["evictions"]
                > before["layouts"][layout_label(wide)]["disk"]["evictions"])
        first.client.close()
        large.client.close()
        assert d.stop() == 0
    finally:
        cleanup(d, root)


def test_a_restarted_daemon_serves_each_layouts_blocks_from_its_own_disk_directory() -> None:
    root = short_tmpdir()
    d = None
    try:
        cfg = _config(root)
        d = start_daemon(cfg)
        small, large = _tier(d, SMALL), _tier(d, LARGE)
        ks, kl = keys_for(10, seed=5), keys_for(4, seed=6)
        assert all(_put(small, SMALL, ks)) and all(_put(large, LARGE, kl))
        small.flush()
        large.flush()
        small.client.close()
        large.client.close()
        assert d.stop() == 0
        d = start_daemon(cfg)
        # both layouts dormant at start (nothing opened, torch not loaded): their disk data counts against
        # disk.max_size before any client comes, and each opens with its first client
        observer = DaemonClient(None, socket_path=d.socket_path, client_name="stats", use_shm=False)
        observer.connect(5)
        dormant = observer.stats()
        observer.close()
        assert dormant["layouts"] == {} and dormant["daemon"]["layouts_dormant"] == 2
        assert dormant["daemon"]["dormant_disk_bytes"] > 0
        large = _tier(d, LARGE)  # the other layout first this time
        small = _tier(d, SMALL)
        assert all(_read(large, LARGE, kl)) and all(_read(small, SMALL, ks))
        stats = small.client.stats()
        assert stats["layouts"][layout_label(SMALL)]["counters"]["disk_hits"] == 10
        small.client.close()
        large.client.close()
        assert d.stop() == 0
    finally:
        cleanup(d, root)


def test_a_layouts_damaged_disk_refuses_that_layout_alone_naming_the_file_and_the_others_go_on() -> None:
    root = short_tmpdir()
    d = None
    try:
        cfg = _config(root)
        d = start_daemon(cfg)
        small, large = _tier(d, SMALL), _tier(d, LARGE)
        ks, kl = keys_for(10, seed=9), keys_for(4, seed=10)
        assert all(_put(small, SMALL, ks)) and all(_put(large, LARGE, kl))
        small.flush()
        large.flush()
        small.client.close()
        large.client.close()
        assert d.stop() == 0
        data = root / "lmdb" / "layouts" / layout_dirname(SMALL) / "data.mdb"
        with open(data, "r+b") as f:  # a truncated file: what a full disk or a crash mid-copy leaves
            f.truncate(100)
        d = start_daemon(cfg)
        large = _tier(d, LARGE)
        with pytest.raises(DaemonError) as exc:
            _tier(d, SMALL)
        assert exc.value.code == ErrorCode.BAD_LAYOUT
        assert f"cannot store layout {layout_label(SMALL)}" in str(exc.value) and str(data.parent) in str(exc.value)
        assert f"kvstore repair --config <your config> --layout {layout_dirname(SMALL)}" in str(exc.value)
        assert all(_read(large, LARGE, kl))  # the daemon and the other layout go on
        assert data.stat().st_size == 100  # the damaged file is left as it was, for inspection
        large.client.close()
        assert d.stop() == 0
        # the repair the refusal names moves that layout's directory aside, and nothing else
        res = subprocess.run([sys.executable, "-m", "kvstore", "repair", "--config", str(cfg), "--layout",
                              layout_dirname(SMALL)], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert [p.name for p in data.parent.parent.glob(f"{layout_dirname(SMALL)}.damaged-*")]
        d = start_daemon(cfg)
        small, large = _tier(d, SMALL), _tier(d, LARGE)
        assert not any(_read(small, SMALL, ks)) and all(_read(large, LARGE, kl))
        assert all(_put(small, SMALL, ks)) and all(_read(small, SMALL, ks))
        small.client.close()
        large.client.close()
        assert d.stop() == 0
    finally:
        cleanup(d, root)


def test_salvage_of_one_layouts_directory_checks_its_blocks_against_the_layout_recorded_there() -> None:
    root = short_tmpdir()
    d = None
    try:
        cfg = _config(root)
        d = start_daemon(cfg)
        large = _tier(d, LARGE)
        kl = keys_for(5, seed=11)
        assert all(_put(large, LARGE, kl))
        large.flush()
        large.client.close()
        assert d.stop() == 0
        assert (root / "lmdb" / "layouts" / layout_dirname(LARGE) / "layout.json").is_file()
        res = subprocess.run([sys.executable, "-m", "kvstore", "repair", "--config", str(cfg), "--layout",
                              layout_dirname(LARGE), "--salvage"], capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert "salvaged 5 blocks" in res.stdout
        d = start_daemon(cfg)
        large = _tier(d, LARGE)
        assert all(_read(large, LARGE, kl))
        large.client.close()
        assert d.stop() == 0
        # --layout on a daemon pinned to one layout is a usage error naming the field
        pinned = write_config(root, daemon={"layouts": "model"})
        res = subprocess.run([sys.executable, "-m", "kvstore", "repair", "--config", str(pinned), "--layout", "x"],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 2 and "daemon.layouts: model" in res.stderr
    finally:
        cleanup(d, root)


def test_a_layout_the_daemon_cannot_store_is_refused_naming_why() -> None:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(_config(root, daemon={"max_layouts": 1}))
        small = _tier(d, SMALL)
        with pytest.raises(DaemonError) as exc:  # one layout more than daemon.max_layouts
            _tier(d, LARGE)
        assert exc.value.code == ErrorCode.BAD_LAYOUT
        assert "daemon.max_layouts = 1" in str(exc.value) and layout_label(LARGE) in str(exc.value)
        assert f"each of them has a client now ({layout_label(SMALL)})" in str(exc.value)
        huge = KVLayout(num_layers=64, num_kv_heads=8, head_dim=128, block_size=16, dtype="float32", model_id="huge")
        with pytest.raises(DaemonError) as exc:  # refused before any room is looked for: the layout count first
            _tier(d, huge)
        assert exc.value.code == ErrorCode.BAD_LAYOUT
        small.client.close()
        assert d.stop() == 0
        d = start_daemon(_config(root))
        with pytest.raises(DaemonError) as exc:  # 8 MiB blocks in 64 KiB of host memory
            _tier(d, huge)
        assert exc.value.code == ErrorCode.BAD_LAYOUT
        assert f"{huge.bytes_per_block} bytes per block" in str(exc.value) and "host.capacity" in str(exc.value)
        assert d.stop() == 0
    finally:
        cleanup(d, root)


@pytest.mark.parametrize(("over", "says"), [
    ({"daemon": {"events": {"enabled": True}}}, "daemon.events"),
    ({"tiers": ["host", "slab"]}, "tiers: slab"),
])
def test_what_any_layout_cannot_do_is_refused_at_start(over: dict, says: str) -> None:
    root = short_tmpdir()
    try:
        with pytest.raises(RuntimeError) as exc:
            start_daemon(_config(root, **over))
        assert says in str(exc.value) and "daemon.layouts" in str(exc.value)
    finally:
        cleanup(None, root)


def test_a_closed_layouts_disk_data_counts_in_max_size_and_gives_way_first() -> None:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(_config(root, daemon={"max_layouts": 1}, disk={"max_size": "1MiB"}))
        small = _tier(d, SMALL)
        assert all(_put(small, SMALL, keys_for(100, seed=1)))
        small.flush()
        small.client.close()
        large = _tier(d, LARGE)  # the one layout's place: SMALL is flushed and closed, its directory stays
        stats = large.client.stats()["daemon"]
        assert stats["layouts_dormant"] == 1 and stats["dormant_disk_bytes"] > 0
        small_dir = root / "lmdb" / "layouts" / layout_dirname(SMALL)
        assert small_dir.is_dir()
        for i in range(0, 240, 8):  # 960 KiB of LARGE blocks: more than the budget leaves beside SMALL's file
            _put(large, LARGE, keys_for(240, seed=2)[i:i + 8])
        large.flush()  # every acknowledged block made durable: room came from the dormant directory first
        assert not small_dir.exists()
        assert f"layout {layout_label(SMALL)} had no client: its" in d.log.read_text()
        assert large.client.stats()["daemon"]["layouts_dormant"] == 0
        large.client.close()
        assert d.stop() == 0
    finally:
        cleanup(d, root)
