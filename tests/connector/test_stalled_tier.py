"""The built-in engine with an embedded store whose disk stops answering reads (a stuck device, a hung network
mount; injected, as a stuck read cannot be made here): the load waits at most its deadline (``deadlines``), then
the engine recomputes what did not come, to the same tokens as an engine with no cache; the late read's bytes are
never used."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from connlib import GREEDY, embedded, make_llm, prompt


def test_a_stalled_disk_read_costs_the_load_deadline_not_the_stall(tmp_path: Path) -> None:
    reference = make_llm().generate([prompt(3, 45)], GREEDY)[0].token_ids
    deadlines = {"load_floor_ms": 300}
    first = make_llm(tmp_path, tiers=["lmdb"], deadlines=deadlines)
    assert first.generate([prompt(3, 45)], GREEDY)[0].token_ids == reference
    embedded(first).close()  # the prompt's 11 full blocks are on disk

    llm = make_llm(tmp_path, tiers=["lmdb"], deadlines=deadlines)
    disk = embedded(llm).store.h.disk
    assert disk is not None
    stall = threading.Event()
    read = disk.get

    def stalled_get(keys: Any, dests: Any) -> list[bool]:
        stall.wait(20)  # until the test ends: far past the load's deadline
        return read(keys, dests)

    disk.get = stalled_get  # type: ignore[method-assign]
    try:
        t0 = time.monotonic()
        out = llm.generate([prompt(3, 45)], GREEDY)[0]
        dt = time.monotonic() - t0
    finally:
        stall.set()
    assert out.token_ids == reference
    assert sum(out.metrics.cached_tokens_by_tier.values()) == 0  # recomputed: nothing waited for the stuck read
    assert dt < 5.0, f"the engine waited {dt:.1f} s on a stuck disk read"
    disk.get = read  # type: ignore[method-assign]
    again = llm.generate([prompt(3, 45)], GREEDY)[0]  # the recomputed blocks are cached on the GPU now
    assert again.token_ids == reference
    embedded(llm).close()
