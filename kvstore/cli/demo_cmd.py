"""``kvstore demo``: a multi-turn chat workload that shows where cached tokens come from."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine import EngineConfig


def _run(args: argparse.Namespace) -> int:
    from kvstore.config import ConfigError, load_config, parse_config  # here, not at the top: pydantic costs `kvstore --help` ~0.3 s
    from engine import CheckpointError
    from engine.default_model import resolve_model
    from kvstore.cli.demo import demo_engine_config, format_answers, format_reports, run_demo
    from kvstore.errors import KVStoreError

    try:
        model = resolve_model(args.model)
        cfg = load_config(args.config)
        data = cfg.model_dump()
        block_bytes = _block_bytes(model, demo_engine_config(cfg, args.gpu_blocks, args.users))
        data["host"]["capacity"] = args.host_blocks * block_bytes
        if args.disk_path:
            data["disk"]["path"] = args.disk_path
        # Unset data paths: the demo's own directories, never a daemon's (``disk.path`` documents them).
        cfg = parse_config(data, args.config or "<defaults>", environ={}).for_role("demo")
    except (ConfigError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    where = f"daemon at {cfg.daemon.socket_path}" if cfg.connector == "sidecar" else f"disk at {cfg.disk.path}"
    print(f"kvstore demo: {args.users} users x {args.turns} turns, GPU pool {args.gpu_blocks} blocks, "
          f"host tier {args.host_blocks} blocks, tiers {cfg.tiers}, {where}")
    try:
        reports = run_demo(cfg, args.users, args.turns, args.gpu_blocks, args.max_tokens,
                           progress=not args.no_progress, model=model)
    except KVStoreError as exc:  # a data directory in use, a daemon that refuses the layout or is not there
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.show_answers:
        print(format_answers(reports))
    print(format_reports(reports))
    print("Between turns the demo moves idle blocks one tier down (GPU -> host, then host -> disk), so later "
          "turns show hits from every tier. Run it again: turn 1 is then served from disk.")
    return 0


def _block_bytes(model: str | Path | None, config: EngineConfig) -> int:
    """Bytes of one KV block of ``model`` under ``config`` (the engine's own layout rule)."""
    from engine.config import ModelArch
    from engine.gguf_loader import checkpoint_config
    from engine.kv_layout import engine_kv_layout

    arch = checkpoint_config(model) if model is not None else ModelArch.tiny()
    return engine_kv_layout(arch, config, model).bytes_per_block


def _positive(text: str) -> int:
    """argparse type: an integer greater than zero."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``demo`` command."""
    p = subparsers.add_parser(
        "demo",
        help="run a multi-turn chat workload through the tiers and print where cached tokens came from",
        description="Run several users' multi-turn chats (shared system prompt) on SmolLM2-135M-Instruct (or "
        "--model) with kvstore as its KV cache, and print per turn the tokens served from the GPU pool, the host "
        "tier and the disk tier, the tokens computed, and the time to first token with the cache and, for the same "
        "prompts, without it (about 15 s on a laptop CPU).",
    )
    p.add_argument("--config", default=None, metavar="PATH",
                   help="YAML config: tiers, policies and the connector (`connector: sidecar` runs the demo through "
                   "a running `kvstore serve`) (default: $KVSTORE_CONFIG, else built-in)")
    p.add_argument("--model", default="default", metavar="PATH",
                   help="'default' (SmolLM2-135M-Instruct), a .gguf file, a checkpoint directory, or 'builtin' "
                   "(the tiny random model) (default: default)")
    p.add_argument("--users", type=_positive, default=4, help="concurrent conversations (default 4)")
    p.add_argument("--turns", type=_positive, default=4, help="turns per conversation (default 4)")
    p.add_argument("--gpu-blocks", type=_positive, default=96, help="GPU pool size in blocks (default 96: small on purpose)")
    p.add_argument("--host-blocks", type=_positive, default=48, help="host tier size in blocks (default 48: small on purpose)")
    p.add_argument("--max-tokens", type=_positive, default=32, help="tokens generated per turn (default 32)")
    p.add_argument("--disk-path", default=None,
                   help="LMDB directory (default: the config's disk.path, else .kvstore-data/demo/lmdb, apart from "
                   "the daemon's .kvstore-data/lmdb)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--show-answers", action="store_true",
                   help="print each turn's questions and the model's answers before the table")
    p.set_defaults(func=_run)
