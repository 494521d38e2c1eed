"""The demo and embedded stores never share a data directory with a running daemon by accident: each kind of
process has its own default, and one pointed at a directory in use is refused, naming it, its holder and what to do."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from daemonlib import cleanup, short_tmpdir, start_daemon
from kvstore.config import DiskConfig, FileConfig, KVStoreConfig, parse_config
from kvstore.config.datadirs import default_data_dir
from kvstore.errors import TierError
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.layout import KVLayout
from kvstore.store.tiered import TieredStore

TINY = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32", model_id="data-dirs")


def test_each_kind_of_process_has_its_own_default_data_directory() -> None:
    cfg = KVStoreConfig()
    assert cfg.disk.path is None and cfg.file.path is None
    roles = ("daemon", "embedded", "demo")
    assert {r: cfg.for_role(r).disk.path for r in roles} == {
        "daemon": ".kvstore-data/lmdb", "embedded": ".kvstore-data/embedded/lmdb", "demo": ".kvstore-data/demo/lmdb"}
    assert {r: cfg.for_role(r).file.path for r in roles} == {
        "daemon": ".kvstore-data/files", "embedded": ".kvstore-data/embedded/files",
        "demo": ".kvstore-data/demo/files"}
    assert cfg.disk.path is None  # for_role returns a copy
    explicit = parse_config({"disk": {"path": "/srv/kv/lmdb"}, "file": {"path": "/srv/kv/files"}}).for_role("demo")
    assert (explicit.disk.path, explicit.file.path) == ("/srv/kv/lmdb", "/srv/kv/files")  # a set path is kept
    for role in roles:  # the field documentation (and so configs/default.yaml) names every default
        assert f"``{default_data_dir(role, 'lmdb')}``" in (DiskConfig.model_fields["path"].description or "")
        assert f"``{default_data_dir(role, 'files')}``" in (FileConfig.model_fields["path"].description or "")
    with pytest.raises(ValueError, match=r"disk.path is unset: KVStoreConfig.for_role"):
        DiskConfig().directory()


def test_demo_and_embedded_store_run_beside_make_runs_daemon_and_are_refused_its_directory(repo: Path) -> None:
    root = short_tmpdir()  # a checkout: `make run` there, then the demo and an embedded store from the same config
    daemon = None
    try:
        shutil.copytree(repo / "configs", root / "configs")
        daemon = start_daemon(root / "configs" / "default.yaml", cwd=root, env={"KVSTORE_METRICS__PORT": "0"})
        daemon_dir = root / ".kvstore-data" / "lmdb"
        assert (daemon_dir / "kvstore.lock").is_file()  # serving any layout, it holds the directory of them all

        # An embedded store on the daemon's own config file, from the same directory (what the README example
        # opens with `connector: embedded`): its own directory, no conflict.
        res = subprocess.run([sys.executable, "-c", EMBEDDED], cwd=root, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        assert res.stdout.strip() == str(root / ".kvstore-data" / "embedded" / "lmdb")

        demo = ["-m", "kvstore", "demo", "--model", "builtin", "--config", "configs/default.yaml", "--users", "1",
                "--turns", "1", "--max-tokens", "2", "--no-progress"]
        res = subprocess.run([sys.executable, *demo], cwd=root, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        assert "disk at .kvstore-data/demo/lmdb" in res.stdout
        assert (root / ".kvstore-data" / "demo" / "lmdb" / "data.mdb").is_file()

        # Pointed at the daemon's directory on purpose: refused, naming the directory, the daemon and what to do.
        res = subprocess.run([sys.executable, *demo, "--disk-path", ".kvstore-data/lmdb"], cwd=root,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 2
        err = res.stderr.strip()
        assert "\n" not in err and "Traceback" not in err, err
        assert err.startswith(f"error: disk.path {daemon_dir} is in use by another kvstore process, "
                              f"pid {daemon.proc.pid} (")
        assert "kvstore serve" in err  # the holder's command line
        assert "stop that one, or give this one another disk.path" in err and "`connector: sidecar`" in err
        with pytest.raises(TierError, match=rf"disk.path {daemon_dir} is in use by another kvstore process, "
                                            rf"pid {daemon.proc.pid} \("):
            explicit = parse_config({"disk": {"path": str(daemon_dir)}, "host": {"capacity": "1MiB"}})
            TieredStore.from_config(explicit, pool=GPUBlockPool(TINY, 4, "cpu"))
        assert daemon.stop() == 0
    finally:
        cleanup(daemon, root)


EMBEDDED = """
import os
from kvstore.config import load_config
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.layout import KVLayout
from kvstore.store.tiered import TieredStore

cfg = load_config("configs/default.yaml", environ={"KVSTORE_HOST__CAPACITY": "1MiB"})  # sizes only: paths as given
store = TieredStore.from_config(cfg, pool=GPUBlockPool(KVLayout(2, 2, 8, 16, "float32", "data-dirs"), 4, "cpu"))
print(os.path.abspath(store.h.disk.path))
store.close()
"""
