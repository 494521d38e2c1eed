"""The router's view of its replicas: where they are, whether they are up, how loaded, which KV layout.

One record per replica (:class:`Replica`), owned here. Load has two sources:
the router's own accounting of requests it forwarded and has not seen finish
(exact and immediate), and the replica's ``/metrics``, which also counts other
clients' requests but only as of the last poll. The policy sees the router's
count plus the *others'* share of the last report (the report minus what the
router had in flight around the poll), so a stale report never counts the
router's own finished requests twice. A replica is *down* after a connection
error or a failed ``/health`` and up again after a successful poll.
``/health`` also gives a kvstore replica's KV layout, the root of its block keys.
A vLLM replica (``keys=vllm``) answers an empty ``/health`` and Prometheus
``/metrics`` (:mod:`kvstore.route.replica_metrics`); its keys follow its
:class:`~kvstore.route.vllm_keys.VllmKeyScheme`, given in its spec.
What a replica holds (and forgetting it on a restart) is the event
subscriber's business, not this module's.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, cast
from urllib.parse import urlsplit

import aiohttp

from kvstore.layout import KVLayout
from kvstore.route.policy import ReplicaLoad
from kvstore.route.replica_metrics import replica_load
from kvstore.route.vllm_keys import (
    DEFAULT_VLLM_BLOCK_SIZE,
    UnsupportedHashError,
    VllmHashAlgo,
    VllmKeyScheme,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplicaSpec:
    """One ``--replica URL[,events=EP][,replay=EP][,name=NAME][,keys=vllm,...]`` argument."""

    name: str
    url: str
    events: str | None = None
    replay: str | None = None
    vllm: VllmKeyScheme | None = None
    """How a vLLM replica keys its blocks (``keys=vllm``); None: a kvstore replica, keyed by kvstore's chain
    rooted in the layout its ``/health`` reports."""
    model: str | None = None
    """A vLLM replica's served model name (``model=``): a request naming another model (a LoRA adapter) is
    routed there by load only, its keys unknown. None: every request is taken to be for the base model."""


_OPTIONS = {"events": "events=ENDPOINT", "replay": "replay=ENDPOINT", "name": "name=NAME",
            "keys": "keys=kvstore|vllm", "block_size": "block_size=TOKENS", "hash_seed": "hash_seed=SEED",
            "hash": "hash=ALGO", "int_hashes": "int_hashes=0|1", "model": "model=NAME"}
_VLLM_OPTIONS = ("block_size", "hash_seed", "hash", "int_hashes", "model")


def _vllm_scheme(text: str, fields: dict[str, str]) -> VllmKeyScheme:
    """The key scheme ``keys=vllm`` options describe; raises ``ValueError`` naming the bad part."""
    block_size = fields.get("block_size", str(DEFAULT_VLLM_BLOCK_SIZE))
    if not block_size.isdigit() or int(block_size) <= 0:
        raise ValueError(f"--replica {text!r}: 'block_size={block_size}' is not a positive number of tokens "
                         "(the replica's --block-size)")
    int_hashes = fields.get("int_hashes", "1")
    if int_hashes not in ("0", "1"):
        raise ValueError(f"--replica {text!r}: 'int_hashes={int_hashes}' is not int_hashes=0 or int_hashes=1 "
                         "(the replica's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)")
    algo = cast(VllmHashAlgo, fields.get("hash", "sha256"))  # VllmKeyScheme refuses a name vLLM does not have
    try:
        return VllmKeyScheme(int(block_size), fields.get("hash_seed"), algo, int_hashes == "1")
    except UnsupportedHashError as exc:
        raise ValueError(f"--replica {text!r}: {exc}") from None


def parse_replica(text: str) -> ReplicaSpec:
    """The :class:`ReplicaSpec` ``text`` describes; raises ``ValueError`` naming the bad part."""
    url, *options = [p.strip() for p in text.split(",")]
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--replica {text!r}: {url!r} is not an http(s)://HOST:PORT URL")
    fields: dict[str, str] = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or key not in _OPTIONS or not value or key in fields:
            raise ValueError(f"--replica {text!r}: {option!r} is not {', '.join(_OPTIONS.values())} (each once)")
        fields[key] = value
    keys = fields.get("keys", "kvstore")
    if keys not in ("kvstore", "vllm"):
        raise ValueError(f"--replica {text!r}: 'keys={keys}' is not keys=kvstore or keys=vllm")
    vllm_only = [f"{k}={fields[k]}" for k in _VLLM_OPTIONS if k in fields]
    if keys == "kvstore" and vllm_only:
        raise ValueError(f"--replica {text!r}: {vllm_only[0]!r} needs keys=vllm (it describes a vLLM replica)")
    return ReplicaSpec(fields.get("name", parts.netloc), url.rstrip("/"), fields.get("events"), fields.get("replay"),
                       _vllm_scheme(text, fields) if keys == "vllm" else None, fields.get("model"))


@dataclass(frozen=True)
class StoreSpec:
    """One ``--store events=EP[,replay=EP][,name=NAME][,serves=R1+R2]`` argument: a sidecar daemon's feed."""

    name: str
    events: str
    replay: str | None = None
    serves: tuple[str, ...] | None = None
    """The replicas that share this store (``None``: every replica)."""


def parse_store(text: str, replicas: Iterable[str]) -> StoreSpec:
    """The :class:`StoreSpec` ``text`` describes, its ``serves`` checked against ``replicas``' names;
    raises ``ValueError`` naming the bad part."""
    fields: dict[str, str] = {}
    for option in (p.strip() for p in text.split(",")):
        key, sep, value = option.partition("=")
        if not sep or key not in ("events", "replay", "name", "serves") or not value or key in fields:
            raise ValueError(f"--store {text!r}: {option!r} is not events=ENDPOINT, replay=ENDPOINT, name=NAME or "
                             "serves=REPLICA+REPLICA (each once)")
        fields[key] = value
    if "events" not in fields:
        raise ValueError(f"--store {text!r}: events=ENDPOINT is missing (the daemon's daemon.events.endpoint)")
    serves = tuple(fields["serves"].split("+")) if "serves" in fields else None
    known = set(replicas)
    unknown = [r for r in serves or () if r not in known]
    if unknown:
        raise ValueError(f"--store {text!r}: serves names {', '.join(unknown)}, not a replica "
                         f"(replicas: {', '.join(sorted(known))})")
    name = fields.get("name", urlsplit(fields["events"]).netloc or fields["events"])
    if name in known:
        raise ValueError(f"--store {text!r}: {name!r} is a replica's name; give the store name=NAME")
    return StoreSpec(name, fields["events"], fields.get("replay"), serves)


@dataclass
class Replica:
    """What the router knows about one replica (changed only by :class:`ReplicaSet`)."""

    spec: ReplicaSpec
    up: bool = False
    reason: str | None = "not polled yet"
    """Why it is down (None when up)."""
    layout: KVLayout | None = None
    requests: int = 0
    """Requests the router forwarded to it that have not finished."""
    tokens: int = 0
    """Their prompt tokens + max_tokens."""
    reported: ReplicaLoad = field(default_factory=lambda: ReplicaLoad(0, 0))
    """The replica's own ``/metrics``, as of the last poll."""
    others: ReplicaLoad = field(default_factory=lambda: ReplicaLoad(0, 0))
    """Of the last report, what other clients had in flight (the report minus the router's own count)."""

    def load(self) -> ReplicaLoad:
        """What the policy weighs: the router's own in-flight work plus other clients' as last reported."""
        return ReplicaLoad(self.requests + self.others.in_flight_requests,
                           self.tokens + self.others.in_flight_tokens, self.up)


class ReplicaSet:
    """The replicas, polled every ``interval`` seconds (``timeout``: the most one poll request may take)."""

    def __init__(self, specs: Iterable[ReplicaSpec], interval: float, timeout: float = 2.0) -> None:
        self.replicas: dict[str, Replica] = {}
        for spec in specs:
            if spec.name in self.replicas:
                raise ValueError(f"two replicas are named {spec.name!r}; give one a name=NAME")
            self.replicas[spec.name] = Replica(spec)
        if not self.replicas:
            raise ValueError("no replicas: give at least one --replica URL")
        self.interval = interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._task: asyncio.Task[None] | None = None
        self.layout: KVLayout | None = None
        """The KV layout every replica reported (the first one's; a replica with another is kept down)."""

    def loads(self) -> dict[str, ReplicaLoad]:
        """Every replica's load (with its up flag)."""
        return {name: r.load() for name, r in self.replicas.items()}

    def mark_down(self, name: str, reason: str) -> None:
        """Send ``name`` no traffic until a poll finds it healthy again."""
        replica = self.replicas[name]
        if replica.up:
            log.warning("replica %s is down: %s", name, reason)
        replica.up, replica.reason = False, reason

    def begin(self, name: str, tokens: int) -> None:
        """Count one forwarded request of ``tokens`` tokens in flight."""
        r = self.replicas[name]
        r.requests += 1
        r.tokens += tokens

    def end(self, name: str, tokens: int) -> None:
        """The request counted by :meth:`begin` finished (or failed)."""
        r = self.replicas[name]
        r.requests -= 1
        r.tokens -= tokens

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Poll every replica once now, then every ``interval`` seconds in the background."""
        await self.poll(session)
        self._task = asyncio.create_task(self._loop(session))

    async def stop(self) -> None:
        """Stop polling."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self, session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.poll(session)

    async def poll(self, session: aiohttp.ClientSession) -> None:
        """Ask every replica's ``/health`` and ``/metrics`` (concurrently) and update its record."""
        await asyncio.gather(*(self._poll_one(session, r) for r in self.replicas.values()))

    async def _poll_one(self, session: aiohttp.ClientSession, replica: Replica) -> None:
        name, url = replica.spec.name, replica.spec.url
        own_before = (replica.requests, replica.tokens)
        try:
            async with session.get(f"{url}/health", timeout=self.timeout) as resp:
                status, health_body = resp.status, await resp.read()
            async with session.get(f"{url}/metrics", timeout=self.timeout) as resp:
                reported = (replica_load(await resp.read()) if resp.status == 200
                            else ReplicaLoad(0, 0))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.mark_down(name, f"{url}: {type(exc).__name__}: {exc}")
            return
        if status != 200:
            self.mark_down(name, f"{url}/health answered {status}")
            return
        problem = self._check_health(replica, health_body)
        if problem is not None:
            self.mark_down(name, problem)
            return
        # The report counts the router's own requests too: take off the most the router had in flight
        # while the report was made (before or after it), so a request that finished meanwhile is not
        # counted twice.
        own_requests = max(own_before[0], replica.requests)
        own_tokens = max(own_before[1], replica.tokens)
        replica.reported = reported
        replica.others = ReplicaLoad(max(reported.in_flight_requests - own_requests, 0),
                                     max(reported.in_flight_tokens - own_tokens, 0))
        if not replica.up:
            log.info("replica %s is up", name)
        replica.up, replica.reason = True, None

    def _check_health(self, replica: Replica, body: bytes) -> str | None:
        """Why ``replica``'s 200 ``/health`` body rules it out, or None. A vLLM replica's body is not read (vLLM
        answers an empty 200); a kvstore one's is its JSON status with the KV layout, or empty (no layout)."""
        if replica.spec.vllm is not None or not body.strip():
            return None  # no kvstore layout: a vLLM replica keyed by its own scheme, or routed by load
        try:
            health = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            return f"{replica.spec.url}/health: not JSON ({exc})"
        return self._check_layout(replica, health.get("kv_layout") if isinstance(health, dict) else None)

    def _check_layout(self, replica: Replica, fields: Any) -> str | None:
        """Why ``replica``'s reported layout rules it out, or None. The first layout seen becomes the set's."""
        if fields is None:
            return None  # not a kvstore engine (no layout): routed by load, its keys unknown
        try:
            layout = KVLayout(**fields)
        except (TypeError, ValueError) as exc:
            return f"{replica.spec.url}/health: kv_layout {fields!r} is not a KV layout ({exc})"
        replica.layout = layout
        if self.layout is None:
            self.layout = layout
        if layout.fingerprint != self.layout.fingerprint:
            return (f"{replica.spec.url}: its KV layout {layout} differs from the other replicas' {self.layout}; "
                    "block keys would never match")
        return None
