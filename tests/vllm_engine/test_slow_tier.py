"""Load or recompute, by cost, on a real vLLM: a tier slower than vLLM's own prefill is not waited for.

The daemon's disk is made slow (each LMDB read takes 30 s: injected, as a slow device cannot be made here),
and its host RAM is empty after a restart, so every load comes from that disk. A new engine measures its
prefill rate on a fresh prompt, then meets prompts whose blocks are all in kvstore: the first is loaded (the
tier's rate is not known yet) and misses its deadline, which bounds the tier's bandwidth; each miss lowers
it, until loading is expected to take longer than vLLM computing the prompt: from then on kvstore leaves
those prompts to vLLM, so they do not wait for the tier. Every output equals the one computed from scratch.
"""

from __future__ import annotations

from pathlib import Path

import rig

SLOW_DISK = """
import os, time
from kvstore.tiers.lmdb.tier import DiskTier
_get = DiskTier.get
def get(self, keys, dests):
    t0 = time.monotonic()
    while os.path.exists({flag!r}) and time.monotonic() - t0 < 30:
        time.sleep(0.05)
    return _get(self, keys, dests)
DiskTier.get = get
"""
PROMPTS = 7


def test_a_tier_slower_than_prefill_is_recomputed_instead_of_waited_for(model: Path) -> None:
    flag = rig.short_tmpdir() / "slow"
    site = rig.Site.start(model, before=SLOW_DISK.format(flag=str(flag)))
    try:
        fresh = rig.prompt_tokens(model, 24 * rig.BLOCK_SIZE, seed=101)
        stored = [rig.prompt_tokens(model, 20 * rig.BLOCK_SIZE + 5, seed=110 + i) for i in range(PROMPTS)]
        one_by_one = [{"prompts": [p], "max_tokens": 1} for p in stored]
        computed = rig.run_engine(model, one_by_one, site.connector())  # from scratch, and saved to kvstore
        site.restart_daemon()  # flushed to LMDB; the host tier is empty: every load reads the slow disk
        flag.touch()
        run = rig.run_engine(model, [{"prompts": [fresh], "max_tokens": 1}, *one_by_one], site.connector())
    finally:
        flag.unlink(missing_ok=True)
        site.close()
        flag.parent.rmdir()
    rounds = [r["outputs"][0] for r in run["rounds"][1:]]
    scratch = [r["outputs"][0] for r in computed["rounds"]]
    seconds = [r["seconds"] for r in rounds]
    cached = [r["num_cached_tokens"] for r in rounds]
    base = [r["seconds"] for r in scratch]
    for i, (r, want) in enumerate(zip(rounds, scratch)):
        assert r["token_ids"] == want["token_ids"], f"prompt {i} decoded otherwise"
    said = "\n".join(line for line in run["log"].splitlines() if "kvstore" in line)[-3000:]
    assert cached[0] > 0, f"the first stored prompt was not tried from kvstore: {cached}\n{said}"  # rates unknown
    assert "kvstore load missed (deadline)" in said, f"no load waited out its deadline on the slow tier:\n{said}"
    assert cached[-3:] == [0, 0, 0], f"the last prompts were still loaded from the slow tier: {cached} {seconds}\n{said}"
    # by then a load from this tier is given up after 12 s or more: none of them waited for it
    assert max(seconds[-3:]) < 2 * max(base), f"recomputed prompts still waited for the tier: {seconds}\n{said}"
    assert "kvstore: recomputing" in run["log"], "the scheduler did not say why it recomputed"
    print(f"TTFT with the slow tier {[round(s, 2) for s in seconds]} s, computed {[round(s, 2) for s in base]} s, "
          f"cached {cached}; last three vs from scratch: {sum(seconds[-3:]) / sum(base[-3:]):.2f}x")
