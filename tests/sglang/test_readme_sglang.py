"""The README's SGLang command line is one SGLang 0.5.23 accepts, and it loads this backend with a valid config."""

from __future__ import annotations

from sglang_stubs import require_sglang

require_sglang()

import argparse
import importlib
import json
import re
import shlex
from pathlib import Path

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
from sglang.srt.server_args import ServerArgs

from connectors.sglang.settings import BackendSettings
from kvstore.config import load_config

REPO = Path(__file__).resolve().parents[2]


def _launch_argv() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("### SGLang", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"python -m sglang\.launch_server (.*?)\n```", section, flags=re.S)
    assert match is not None, "the README's SGLang set-up shows no `python -m sglang.launch_server` command"
    return shlex.split(match.group(1).replace("\\\n", " "))


def test_readme_launch_flags_parse_and_load_the_backend() -> None:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(_launch_argv())  # SystemExit on any flag SGLang does not have
    assert args.enable_hierarchical_cache and args.hicache_storage_backend == "dynamic"
    extra = json.loads(args.hicache_storage_backend_extra_config)
    cls = getattr(importlib.import_module(extra["module_path"]), extra["class_name"])
    assert issubclass(cls, HiCacheStorage)
    settings = BackendSettings.from_extra_config(extra)
    assert settings.kvstore_config is not None
    layout = load_config(REPO / settings.kvstore_config).model.layout()
    # one page of Llama-3.1-8B (32 layers, 8 KV heads of 128, bf16) on one TP rank is one block
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.dtype) == (32, 8, 128, "bfloat16")
    assert layout.block_size == args.page_size
