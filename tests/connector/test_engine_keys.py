"""Keys, layouts and the block store that engine adapters (vLLM, SGLang) share: connectors/engine_keys.py, engine_store.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from connectors.engine_keys import PromptKeys, engine_layout
from connectors.engine_store import EngineBlockStore, daemon_model_section
from kvstore.hashing import block_keys
from kvstore.tiers.lmdb.tier import DiskTier
from kvstore.tiers.host.tier import HostTier


def test_engine_layout_has_the_chunk_bytes_and_an_identity_per_model_dtype_and_format() -> None:
    base = engine_layout("vllm", "m", "torch.float16", 16, 2 << 20, "tp=1")
    assert (base.block_size, base.bytes_per_block) == (16, 2 << 20)
    assert base.head_dim <= 4096 and base.num_kv_heads <= 1024 and base.num_layers <= 1024
    others = [engine_layout("vllm", "m2", "float16", 16, 2 << 20, "tp=1"),
              engine_layout("vllm", "m", "bfloat16", 16, 2 << 20, "tp=1"),
              engine_layout("vllm", "m", "float16", 16, 2 << 20, "tp=2"),
              engine_layout("sglang", "m", "float16", 16, 2 << 20, "tp=1")]
    assert len({base.fingerprint, *(o.fingerprint for o in others)}) == 5
    assert engine_layout("vllm", "m", "fp8_e4m3", 16, 4096).model_id == "vllm|m|fp8_e4m3|4096B|"


def test_engine_layout_refuses_bytes_that_are_not_whole_kv_rows() -> None:
    with pytest.raises(ValueError, match=r"vllm chunk of 1000 bytes for 16 tokens of float16 is not a whole number"):
        engine_layout("vllm", "m", "float16", 16, 1000)


def test_prompt_keys_are_kvstores_block_keys_however_the_prompt_grows() -> None:
    layout = engine_layout("vllm", "m", "float16", 4, 512)
    tokens = list(range(40))
    chain = PromptKeys(layout, "tenant")
    assert chain.key(tokens[:8], 1) == block_keys(tokens, layout, "tenant")[0]
    assert chain.keys(tokens, 10) == block_keys(tokens, layout, "tenant")
    assert PromptKeys(layout, None).keys(tokens, 2) != chain.keys(tokens, 2)
    with pytest.raises(ValueError, match="block 10 ends at token 44, past the prompt's 40 tokens"):
        chain.key(tokens, 11)


def test_store_prefix_runs_across_tiers_and_a_disk_hit_is_copied_up(tmp_path: Path) -> None:
    layout = engine_layout("vllm", "m", "float16", 4, 512)
    host, disk = HostTier(layout, 8 * 512), DiskTier(layout, str(tmp_path), 1 << 24)
    store = EngineBlockStore(layout, [host, disk])
    keys = block_keys(list(range(16)), layout)
    blocks = [torch.full((512,), i, dtype=torch.uint8) for i in range(4)]
    disk.put(keys[:3], blocks[:3])
    host.put(keys[:1] + keys[3:], [blocks[0], blocks[3]])
    assert store.contains_prefix(keys) == 4  # host 0, disk 1-2, host 3
    dests = [torch.empty(512, dtype=torch.uint8) for _ in range(2)]
    assert store.get(keys[1:3], dests) == [True, True]
    assert all(torch.equal(d, b) for d, b in zip(dests, blocks[1:3]))
    assert host.contains_prefix(keys) == 4  # the disk hits are in the host tier now
    store.close()


def test_daemon_model_section_describes_the_layout() -> None:
    layout = engine_layout("vllm", "m", "float16", 16, 4096)
    assert daemon_model_section(layout).splitlines()[:2] == ["model:", "  model_id: vllm|m|float16|4096B|"]
