"""The remote tier over TLS against a Redis Cluster whose client, bus and replication links all speak TLS
only (``rediss-cluster://``, a throwaway CA made with ``openssl``): the contract basics, and a plain-text
client refused as a counted miss. (The standalone TLS server is tested in test_remote_groups.py.)"""

from __future__ import annotations

import torch
from remotelib import remote_tier
from tiers_testlib import LAYOUTS, empty_blocks, make_blocks, make_keys

from benchmarks.redis_servers import RedisClusterProcs

L = LAYOUTS["float16"]


def test_contract_basics_over_tls_to_a_tls_cluster(tls_cluster: RedisClusterProcs) -> None:
    assert tls_cluster.url.startswith("rediss-cluster://")
    ca = tls_cluster.servers[0].tls_dir / "ca.crt"  # type: ignore[operator]
    tier = remote_tier(L, tls_cluster.url, group_blocks=1, key_prefix="tlsc:", tls_ca_file=str(ca), listen_evictions=True)
    try:
        keys, blocks = make_keys(L, 12, seed=11), make_blocks(L, 12, seed=11)
        assert tier.put(keys[:10], blocks[:10]) == [True] * 10  # 10 keys over the three primaries' slots
        client = tier._connected()
        assert len({client.get_node_from_key(tier.redis_key(k)).name for k in keys[:10]}) > 1  # split by node
        dests = empty_blocks(L, 12)
        assert tier.get(keys, dests) == [True] * 10 + [False] * 2
        assert all(torch.equal(d, b) for d, b in zip(dests[:10], blocks[:10]))
        assert tier.contains_prefix(keys) == 10 and tier.delete(keys[9:]) == 1 and tier.contains_prefix(keys) == 9
        s = tier.stats()
        assert (s.hits, s.misses, s.puts, s.errors) == (10, 2, 10, 0)
        assert s.used_bytes > 0  # INFO memory over TLS from every primary
    finally:
        tier.close()


def test_plain_text_to_a_tls_cluster_is_a_counted_miss(tls_cluster: RedisClusterProcs) -> None:
    plain = remote_tier(L, tls_cluster.url.replace("rediss-cluster://", "redis-cluster://"), group_blocks=1,
                        key_prefix="tlsc:", listen_evictions=False)
    try:
        keys = make_keys(L, 2, seed=12)
        assert plain.get(keys, empty_blocks(L, 2)) == [False, False]
        assert plain.stats().errors >= 1
    finally:
        plain.close()
