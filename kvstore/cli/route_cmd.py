"""``kvstore route``: a KV-cache-aware reverse proxy in front of several engine replicas."""

from __future__ import annotations

import argparse
import sys


def _route(args: argparse.Namespace) -> int:
    import threading

    from engine import CheckpointError
    from engine.default_model import resolve_model
    from engine.model_text import load_model_text
    from engine.server.prompt import PromptRenderer
    from kvstore.cli.http_app import run_app
    from kvstore.route.index import RouterIndex
    from kvstore.route.policy import CostPolicy
    from kvstore.route.proxy import Router
    from kvstore.route.replica_set import ReplicaSet, parse_replica, parse_store
    from kvstore.route.subscriber import EventSubscriber, ReplicaEndpoints, StoreEndpoints

    subscriber: EventSubscriber | None = None
    try:
        specs = [parse_replica(text) for text in args.replica]
        replicas = ReplicaSet(specs, args.poll_interval)
        stores = [parse_store(text, replicas.replicas) for text in args.store]
        if len({s.name for s in stores}) != len(stores):
            raise ValueError("two --store arguments have one name; give one a name=NAME")
        weights = {k: v for k, v in (("block_weight", args.block_weight), ("request_weight", args.request_weight),
                                     ("token_weight", args.token_weight)) if v is not None}
        policy = CostPolicy(**weights)
        # The served model's text side only (no weights): the same token ids the replicas run.
        renderer = PromptRenderer(load_model_text(resolve_model(args.model)))
    except (CheckpointError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    index = RouterIndex()
    followed = {s.name: ReplicaEndpoints(s.events, s.replay) for s in specs if s.events is not None}
    shared = {s.name: StoreEndpoints(s.events, s.replay, s.serves) for s in stores}
    if shared:  # a store may serve a replica that publishes nothing itself: it must be in the index too
        for spec in specs:
            index.add_replica(spec.name)
    lock = threading.Lock()
    try:
        if followed or shared:
            subscriber = EventSubscriber(index, followed, stores=shared, lock=lock)
            subscriber.start()
        router = Router(replicas, index, policy, renderer.token_ids, lock,
                        subscriber.stats if subscriber is not None else None)
        names = ", ".join(f"{s.name}{' (events)' if s.events else ''}" for s in specs)
        extra = "".join(f"; store {s.name} serving {'+'.join(s.serves) if s.serves else 'every replica'}"
                        for s in stores)
        run_app(router.app(), args.host, args.port,
                lambda port: f"kvstore route: {len(specs)} replicas ({names}){extra} behind http://{args.host}:{port}")
    finally:
        if subscriber is not None:
            subscriber.close()
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``route`` command."""
    p = subparsers.add_parser(
        "route",
        help="KV-cache-aware reverse proxy: send each request to the replica that holds its prefix",
        description="An OpenAI-compatible reverse proxy (POST /v1/completions, /v1/chat/completions, streaming "
        "included) in front of engine replicas (`kvstore engine serve`, or vLLM with keys=vllm). It tokenizes "
        "each prompt with the served model's tokenizer and chat template, computes kvstore's block keys (rooted "
        "in the KV layout the replicas report on /health) and vLLM's for vLLM replicas, looks them up in an "
        "index built from the replicas' KV events, and picks "
        "the replica with the lowest cost: uncached prompt blocks (weighted by tier) plus load (in-flight "
        "requests and tokens: its own accounting plus the replicas' /metrics). A replica that is down gets no "
        "traffic and a request it refused is retried on the next best one. POST /route answers the choice "
        "without forwarding; GET /metrics (Prometheus text) reports decisions, hit blocks, replicas and event lag, "
        "GET /stats the same as JSON.",
    )
    p.add_argument("--store", action="append", default=[], metavar="events=EP[,replay=EP,name=NAME,serves=R1+R2]",
                   help="a sidecar daemon's KV events (`kvstore serve --events-endpoint EP`, or daemon.events): the "
                   "blocks it holds count, in its host and disk tiers, for the replicas that share it (serves=, "
                   "replica names joined by +; default every replica); repeat per daemon")
    p.add_argument("--replica", action="append", required=True,
                   metavar="URL[,events=EP,replay=EP,name=NAME,keys=vllm,...]",
                   help="a replica's base URL, with its ZMQ KV-events endpoint (events=tcp://HOST:PORT), its "
                   "replay endpoint (replay=...), and a name (default: HOST:PORT of the URL); repeat per replica. "
                   "A replica without events= is routed by load only. A vLLM replica: keys=vllm, with "
                   "block_size=N (its --block-size, default 16), hash_seed=S (its PYTHONHASHSEED, if set), "
                   "hash=ALGO (its --prefix-caching-hash-algo, default sha256), int_hashes=0|1 (its "
                   "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, default 1) and model=NAME (its served model: requests "
                   "for another, a LoRA adapter, go to it by load only); its /metrics are read as Prometheus "
                   "text")
    p.add_argument("--model", default="default", metavar="PATH",
                   help="the model the replicas serve, for its tokenizer and chat template: 'default', a .gguf "
                   "file, a checkpoint directory, or 'builtin' (default: default)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on; 0 picks a free one (default: 8080)")
    p.add_argument("--poll-interval", type=float, default=1.0, metavar="SECONDS",
                   help="how often each replica's /health and /metrics are read (default: 1)")
    p.add_argument("--block-weight", type=float, default=None,
                   help="cost of one prompt block a replica must compute (default: CostPolicy's, 1)")
    p.add_argument("--request-weight", type=float, default=None,
                   help="cost of one request in flight on a replica (default: CostPolicy's, 0)")
    p.add_argument("--token-weight", type=float, default=None,
                   help="cost of one token in flight on a replica (default: CostPolicy's, 0.05/16: a queued token "
                   "costs 5%% of an uncached one; see docs/BENCHMARKS.md ## route)")
    p.set_defaults(func=_route)
