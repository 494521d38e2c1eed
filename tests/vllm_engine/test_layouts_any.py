"""One daemon for every model on the host (``daemon.layouts: any``): real vLLM engines of two KV layouts.

The daemon is ``make run``'s, ``configs/default.yaml`` as shipped (only its paths moved): the README's first
command starts a daemon vLLM loads from, with no other daemon and no model section to write. An ``fp8_e4m3`` engine and an ``fp8_e5m2`` engine (the same weights; vLLM keeps both formats in ``uint8``, so
only the layout's identity tells them apart) use one daemon with no model section. Neither is refused; the
second finds none of the first's blocks; a new ``fp8_e4m3`` process loads its own layout's blocks and decodes
as the first did; the daemon reports the two layouts apart.
"""

from __future__ import annotations

from pathlib import Path

import rig
from kvstore.daemon.client.connection import DaemonClient
from prompts import Prompts
from rig import tokens

BS = rig.BLOCK_SIZE


def test_two_layouts_share_one_daemon_each_finding_only_its_own_blocks(model: Path, prompts: Prompts) -> None:
    site = rig.Site.start(model, any_layout=True, shipped="default.yaml")  # make run's daemon
    try:
        job = [{"prompts": [prompts.long], "max_tokens": 12}]
        first = rig.run_engine(model, job, site.connector(), kv_cache_dtype="fp8_e4m3")
        other = rig.run_engine(model, job, site.connector(), kv_cache_dtype="fp8_e5m2")
        assert other["rounds"][0]["external_prefix_cache_hits"] == 0  # the other layout's blocks are not its own
        again = rig.run_engine(model, job, site.connector(), kv_cache_dtype="fp8_e4m3")
        assert again["rounds"][0]["external_prefix_cache_hits"] == 33 * BS
        assert tokens(again, 0) == tokens(first, 0)
        assert site.daemon is not None
        observer = DaemonClient(None, socket_path=site.daemon.socket_path, client_name="test", use_shm=False)
        observer.connect(5)
        layouts = observer.stats()["layouts"]
        observer.close()
        assert len(layouts) == 2 and {v["layout"]["model_id"].split("kv=")[-1][:8] for v in layouts.values()} == {
            "fp8_e4m3", "fp8_e5m2"}
    finally:
        site.close()
