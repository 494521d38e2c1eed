"""A daemon serving any layout (``daemon.layouts: any``) against clients that bring layouts to hurt it.

Any client (a local process with the socket, an authenticated TCP tenant) chooses the layout its HELLO
carries, so what a layout costs the daemon is bounded whatever the layout, and a layout nobody uses gives
its place back:

- a legal 4-byte block costs at most ``daemon.max_layout_slots`` slots' bookkeeping, and never stalls others;
- HELLO-only logins of junk layouts leave nothing behind: ``max_layouts`` stays free for real models, also
  after a restart; a layout with data but no client makes room for a new one and reopens on demand;
- a tenant holds at most ``daemon.max_layouts_per_tenant`` layouts;
- a model id longer than a directory name keeps its fingerprint there (two formats of one model, two dirs);
- a layout's first open runs off the event loop; a damaged layout is walked once, not per retried HELLO.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from daemonlib import (cleanup, free_port, keys_for, layout_tier, put_layout, read_layout, rss, short_tmpdir,
                       start_daemon, write_config)
from kvstore.daemon.client.connection import DaemonClient
from kvstore.daemon.wire.frames import DaemonError, ErrorCode
from kvstore.daemon.server.layout_dirs import DIRNAME_CHARS, layout_dirname, layout_label
from kvstore.daemon.client.tier import DaemonTier
from kvstore.layout import KVLayout

TINY = KVLayout(num_layers=1, num_kv_heads=1, head_dim=1, block_size=1, dtype="float16", model_id="tiny")  # 4 B
SMALL = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16", model_id="small")  # 512 B
LARGE = KVLayout(num_layers=4, num_kv_heads=2, head_dim=16, block_size=4, dtype="float32", model_id="large")  # 4 KiB
HF_SNAPSHOT = ("/root/.cache/huggingface/hub/models--HuggingFaceTB--SmolLM2-135M-Instruct/snapshots/"
               "12fd25f77366fa6b3b4b768ec3050bf629380bac")  # 125 characters: what vLLM names a downloaded model by


def _config(root: Path, host: int | str = 64 * 1024, **over: dict) -> Path:
    daemon = {"layouts": "any", **over.pop("daemon", {})}
    return write_config(root, daemon=daemon, host={"capacity": host, "prefault": False}, **over)


_tier, _put, _read = layout_tier, put_layout, read_layout


class _Watch:
    """A client of another layout doing small puts and gets in a loop; the slowest one, in seconds."""

    def __init__(self, tier: DaemonTier, layout: KVLayout) -> None:
        self.tier, self.layout, self.slowest, self.ops = tier, layout, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Watch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            keys = keys_for(2, seed=1000 + i)
            t0 = time.monotonic()
            assert all(_put(self.tier, self.layout, keys)) and all(_read(self.tier, self.layout, keys))
            self.slowest = max(self.slowest, time.monotonic() - t0)
            self.ops += 1
            i += 1
            time.sleep(0.02)


def test_a_four_byte_block_layout_costs_a_bounded_amount_and_stalls_nobody() -> None:
    root = short_tmpdir()
    d = None
    try:
        # 64 MiB of 4-byte blocks would be 16 Mi slots: today's bound is daemon.max_layout_slots = 2^20
        d = start_daemon(_config(root, host="64MiB"))
        small = _tier(d, SMALL, "real engine")
        assert all(_put(small, SMALL, keys_for(4)))
        before = rss(d.proc.pid)
        with _Watch(small, SMALL) as watch:
            t0 = time.monotonic()
            tiny = _tier(d, TINY, "hostile")
            hello_s = time.monotonic() - t0
            time.sleep(0.3)
        grown = rss(d.proc.pid) - before
        assert hello_s < 3, f"the 4-byte layout's HELLO took {hello_s:.1f} s"
        assert grown < 96 << 20, f"a 4-byte-block layout grew the daemon by {grown >> 20} MiB"
        assert watch.ops and watch.slowest < 1.0, f"another client waited {watch.slowest:.2f} s"
        assert tiny.client.hello is not None and tiny.client.hello.num_slots == 1 << 20
        assert "it gets daemon.max_layout_slots = 1048576" in d.log.read_text()
        keys = keys_for(64, seed=5)
        assert all(_put(tiny, TINY, keys)) and all(_read(tiny, TINY, keys))  # the layout itself still works
        tiny.client.close()
        small.client.close()
        assert d.stop() == 0
    finally:
        cleanup(d, root)


def test_junk_logins_never_use_up_max_layouts_not_even_after_a_restart() -> None:
    root = short_tmpdir()
    d = None
    try:
        cfg = _config(root, daemon={"max_layouts": 2})
        d = start_daemon(cfg)
        for i in range(8):  # HELLO-only logins, each a new layout, storing nothing
            junk = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float16", model_id=f"junk{i}")
            _tier(d, junk, "junk").client.close()
        time.sleep(0.5)  # the last logout's close runs on the daemon's executor
        small = _tier(d, SMALL, "real engine")
        assert all(_put(small, SMALL, keys_for(8)))
        small.flush()
        small.client.close()
        layouts = root / "lmdb" / "layouts"
        assert {p.name for p in layouts.iterdir()} == {layout_dirname(SMALL)}, "junk layouts left directories"
        assert d.stop() == 0
        d = start_daemon(cfg)
        small, large = _tier(d, SMALL, "real engine"), _tier(d, LARGE, "second model")
        assert all(_read(small, SMALL, keys_for(8))) and all(_put(large, LARGE, keys_for(3)))
        small.client.close()
        large.client.close()
        assert d.stop() == 0
    finally:
        cleanup(d, root)


def test_a_layout_with_data_but_no_client_makes_room_and_reopens_on_demand() -> None:
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(_config(root, daemon={"max_layouts": 1}))
        ks, kl = keys_for(10, seed=1), keys_for(3, seed=2)
        small = _tier(d, SMALL, "first model")
        assert all(_put(small, SMALL, ks))
        small.client.close()  # acknowledged blocks, no client: the next layout takes its place
        large = _tier(d, LARGE, "second model")
        assert all(_put(large, LARGE, kl)) and all(_read(large, LARGE, kl))
        with pytest.raises(DaemonError) as exc:  # the one layout has a client now: refused, naming it
            _tier(d, SMALL, "first model again")
        assert exc.value.code == ErrorCode.BAD_LAYOUT and f"has a client now ({layout_label(LARGE)})" in str(exc.value)
        large.client.close()
        small = _tier(d, SMALL, "first model again")
        assert all(_read(small, SMALL, ks)), "the closed layout's flushed blocks must be served from its disk"
        assert small.client.stats()["daemon"]["layouts_closed"] >= 2
        assert f"closing layout {layout_label(SMALL)}" in d.log.read_text()
        small.client.close()
        assert d.stop() == 0
    finally:
        cleanup(d, root)


def test_a_tenant_holds_at_most_max_layouts_per_tenant() -> None:
    root = short_tmpdir()
    d = None
    salts = {"token-a": "salt-a", "token-b": "salt-b"}
    try:
        d = start_daemon(_config(root, daemon={"tcp_host": "127.0.0.1", "tcp_port": free_port(), "token": "admin",
                                               "tenant_salts": salts, "max_layouts_per_tenant": 1}))
        assert d.tcp is not None
        host, port = d.tcp.rsplit(":", 1)

        def tenant(layout: KVLayout, token: str) -> DaemonTier:
            c = DaemonClient(layout, tcp=(host, int(port)), token=token, client_name=token)
            c.connect(10)
            return DaemonTier(layout, c)

        a_small = tenant(SMALL, "token-a")
        with pytest.raises(DaemonError) as exc:
            tenant(LARGE, "token-a")
        assert exc.value.code == ErrorCode.BAD_LAYOUT
        assert "daemon.max_layouts_per_tenant = 1" in str(exc.value) and layout_label(SMALL) in str(exc.value)
        b_large = tenant(LARGE, "token-b")  # another tenant is not held back by the first
        a_again = tenant(SMALL, "token-a")  # nor is a second client of a layout the tenant holds
        assert all(_put(b_large, LARGE, keys_for(2))) and all(_put(a_again, SMALL, keys_for(2)))
        a_small.client.close()
        a_again.client.close()
        a_large = tenant(LARGE, "token-a")  # its clients of SMALL gone, it may move to another layout
        assert all(_put(a_large, LARGE, keys_for(2, seed=3)))
        for t in (a_large, b_large):
            t.client.close()
        assert d.stop() == 0
    finally:
        cleanup(d, root)


def test_a_long_model_id_keeps_its_fingerprint_in_its_directory_name() -> None:
    bf16 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16", model_id=HF_SNAPSHOT)
    fp16 = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16", model_id=HF_SNAPSHOT)
    names = {layout_dirname(bf16), layout_dirname(fp16)}
    assert len(names) == 2 and all(len(n) <= DIRNAME_CHARS for n in names)
    assert all(n.endswith(f"_{lay.fingerprint.hex()[:8]}") for n, lay in zip(sorted(names), sorted(
        [bf16, fp16], key=layout_dirname)))
    assert layout_label(bf16).startswith("12fd25f77366fa6b3b4b768ec3050bf629380bac|bfloat16|4t@")
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(_config(root))
        one, two = _tier(d, bf16, "bf16 engine"), _tier(d, fp16, "fp16 engine")  # was: "in use" for the second
        assert all(_put(one, bf16, keys_for(3))) and all(_put(two, fp16, keys_for(3)))
        assert all(_read(one, bf16, keys_for(3))) and all(_read(two, fp16, keys_for(3)))
        one.client.close()
        two.client.close()
        assert d.stop() == 0
    finally:
        cleanup(d, root)


SLOW_OPEN = """
import time
from kvstore.daemon.server import daemon as server
_open = server.DaemonServer._open_shelf
def _slow(self, layout):
    if layout.model_id == "slow":
        time.sleep(3)  # what a big LMDB directory's damage walk costs
    return _open(self, layout)
server.DaemonServer._open_shelf = _slow
"""


def test_a_layouts_first_open_never_stalls_the_other_clients() -> None:
    slow = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float16", model_id="slow")
    root = short_tmpdir()
    d = None
    try:
        d = start_daemon(_config(root), before=SLOW_OPEN)
        small = _tier(d, SMALL, "served engine")
        with _Watch(small, SMALL) as watch:
            second: list[DaemonTier] = []
            late = threading.Thread(target=lambda: second.append(_tier(d, slow, "second of slow")))
            first = _tier(d, slow, "new engine")  # 3 s to open; the second client waits for the same open
            late.start()
            late.join(10)
        assert watch.ops >= 10 and watch.slowest < 1.0, f"another client waited {watch.slowest:.2f} s"
        assert second and all(_put(first, slow, keys_for(2))) and all(_read(second[0], slow, keys_for(2)))
        for t in (small, first, second[0]):
            t.client.close()
        assert d.stop() == 0
    finally:
        cleanup(d, root)


COUNT_WALKS = """
import sys
from kvstore.tiers.lmdb import check
_walk = check.check_walkable_databases
def _counted(path, hint=None):
    print("WALK", path, file=sys.stderr, flush=True)
    return _walk(path, hint)
check.check_walkable_databases = _counted
"""


def test_a_damaged_layout_is_walked_once_not_for_every_retried_hello() -> None:
    root = short_tmpdir()
    d = None
    try:
        cfg = _config(root)
        d = start_daemon(cfg)
        small = _tier(d, SMALL)
        assert all(_put(small, SMALL, keys_for(5)))
        small.flush()
        small.client.close()
        assert d.stop() == 0
        data = root / "lmdb" / "layouts" / layout_dirname(SMALL) / "data.mdb"
        with open(data, "r+b") as f:
            f.truncate(100)
        d = start_daemon(cfg, before=COUNT_WALKS)
        messages = set()
        for _ in range(4):  # an engine retrying its login
            with pytest.raises(DaemonError) as exc:
                _tier(d, SMALL)
            assert exc.value.code == ErrorCode.BAD_LAYOUT
            messages.add(str(exc.value))
        assert len(messages) == 1 and "kvstore repair" in messages.pop()
        walks = [line for line in d.log.read_text().splitlines() if line.startswith("WALK")]
        assert len(walks) == 1, f"the damaged layout was walked {len(walks)} times"
        data.unlink()  # what a repair does: its files change, so the next login tries again (a fresh environment)
        (data.parent / "lock.mdb").unlink(missing_ok=True)
        small = _tier(d, SMALL)
        assert all(_put(small, SMALL, keys_for(2)))
        small.client.close()
        assert d.stop() == 0
    finally:
        cleanup(d, root)


def test_a_layout_label_names_the_engine_model_dtype_and_block_size_not_every_byte_format_field() -> None:
    from connectors.engine_keys import engine_layout

    vllm = engine_layout("vllm-blocks", "weights@09c7838fbdf7985a", "torch.bfloat16", 32, 737280,
                         "layers=30|FullAttentionSpec|kv=auto|tensor=bfloat16|skip=|weights_quant=None")
    fp8 = engine_layout("vllm-blocks", "HuggingFaceTB/SmolLM2-135M-Instruct@main", "fp8_e4m3", 16, 368640, "x")
    assert layout_label(vllm) == f"vllm:weights@09c7838f|bfloat16|32t@{vllm.fingerprint.hex()[:8]}"
    assert layout_label(fp8) == f"vllm:SmolLM2-135M-Instruct@main|fp8_e4m3|16t@{fp8.fingerprint.hex()[:8]}"
