"""``kvstore engine serve``: the built-in engine behind an OpenAI-compatible HTTP server (one replica).

Prefix caching goes through a kvstore connector (the ``--config`` file's
``connector``; embedded by default), and with ``--events-endpoint`` (or the
config's ``events`` section) the store's block events are published over ZMQ
for ``kvstore route``.
"""

from __future__ import annotations

import argparse
import sys

from kvstore.cli.engine_args import add_engine_args, engine_config


def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web  # noqa: F401  (fail here, before the model loads, if aiohttp is missing)

    from connectors import KVConnector, build_connector
    from engine import LLM, CheckpointError
    from engine.default_model import resolve_model, served_name
    from engine.model_text import ModelText
    from engine.server.app import EngineServer
    from engine.server.prompt import PromptRenderer
    from engine.server.worker import EngineWorker
    from kvstore.cli.http_app import run_app
    from kvstore.cli.replica_events import ReplicaEvents
    from kvstore.config import load_config
    from kvstore.config.datadirs import DATA_ROOT
    from kvstore.errors import KVStoreError

    replica = args.replica_id or f"{args.host}:{args.port}"
    connector: KVConnector | None = None
    events: ReplicaEvents | None = None
    worker: EngineWorker | None = None
    try:
        cfg = load_config(args.config)
        # Several replicas run from one checkout: unset data paths get a directory per replica.
        cfg = cfg.model_copy(deep=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in replica)
        cfg.disk.path = cfg.disk.path or f"{DATA_ROOT}/engine-{safe}/lmdb"
        cfg.file.path = cfg.file.path or f"{DATA_ROOT}/engine-{safe}/files"
        connector = build_connector(cfg)
        llm = LLM(resolve_model(args.model), config=engine_config(args), connector=connector)
        events = ReplicaEvents.start(cfg, connector, replica, args.events_endpoint, args.replay_endpoint)
        worker = EngineWorker(llm)
        server = EngineServer(worker, PromptRenderer(ModelText(llm.tokenizer, llm.chat_template)),
                              args.served_model_name or served_name(args.model), replica, llm.pool.layout,
                              lambda: {**events.stats(), **_daemon_section(connector)},
                              aliases=() if args.served_model_name else (args.model,))
        if resolve_model(args.model) is None:
            print("kvstore engine serve: --model builtin is the tiny model with random weights (for tests): its "
                  "answers are random text; --model default serves SmolLM2-135M-Instruct", file=sys.stderr)
        worker.start()
        run_app(server.app(), args.host, args.port,
                lambda port: f"kvstore engine serve: replica {replica} ({args.model}) listening on "
                f"http://{args.host}:{port}{events.banner()}")
    except (CheckpointError, ValueError, KVStoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if worker is not None:
            worker.close()
        if events is not None:
            events.close()
        if connector is not None:
            connector.close()
    return 0


def _daemon_section(connector: object) -> dict[str, object]:
    """``{"daemon": health}`` for a sidecar connector (its breaker and misses, for ``/stats`` and ``/metrics``)."""
    from connectors.sidecar import SidecarConnector

    health = connector.daemon_health() if isinstance(connector, SidecarConnector) else None
    return {"daemon": health} if health is not None else {}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``engine`` command (``engine serve``)."""
    p = subparsers.add_parser("engine", help="run the built-in engine as a server",
                              description="The built-in paged-attention engine as a long-running server.")
    sub = p.add_subparsers(dest="engine_command", metavar="SUBCOMMAND")
    sub.required = True
    s = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server over the built-in engine (one replica for `kvstore route`)",
        description="Serve the built-in engine over HTTP: POST /v1/completions and /v1/chat/completions "
        "(OpenAI-compatible; \"stream\": true for server-sent events; usage.prompt_tokens_details.cached_tokens "
        "counts the prompt tokens served from the prefix cache), GET /health (status and the KV layout block "
        "keys are rooted in), GET /metrics (Prometheus text: in-flight requests and tokens, totals, GPU blocks, KV events), GET /stats "
        "(the same as JSON) and GET /v1/models. "
        "Concurrent requests are batched by the engine. The prefix cache goes through kvstore as --config says "
        "(default: an embedded store; unset data paths become .kvstore-data/engine-<replica-id>/). Chat requests "
        "use the model's chat template, or kvstore's role-tagged fallback when it has none (the built-in model).",
    )
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default: 8000)")
    s.add_argument("--config", default=None, metavar="PATH",
                   help="kvstore YAML config: connector, tiers, policies and the events section "
                   "(default: $KVSTORE_CONFIG, else all defaults)")
    s.add_argument("--replica-id", default=None, metavar="ID",
                   help="this replica's name in KV events and responses (default: HOST:PORT)")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name requests must use, if they name one, and /v1/models lists (default: "
                   "SmolLM2-135M-Instruct for --model default, builtin-random for builtin, else the --model value)")
    s.add_argument("--events-endpoint", default=None, metavar="ZMQ",
                   help="publish the store's KV events on this ZMQ PUB endpoint, e.g. tcp://127.0.0.1:5557 "
                   "(overrides events.endpoint in --config and enables events)")
    s.add_argument("--replay-endpoint", default=None, metavar="ZMQ",
                   help="serve missed event batches and the full block report on this ZMQ ROUTER endpoint "
                   "(overrides events.replay_endpoint)")
    s.set_defaults(func=_serve)
