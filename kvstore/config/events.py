"""The ``events:`` section: publish this store's KV events for a router (``kvstore route``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, field_validator

from kvstore.config.section import Section

_SCHEMES = ("tcp://", "ipc://", "inproc://")


class EventsConfig(Section):
    """KV events in vLLM's msgpack shape over ZMQ: block stored / removed / all cleared, with the tier.

    The replica binds both endpoints; the router connects. A router that missed batches asks
    ``replay_endpoint`` for them, or for a full report of every block held when they are older
    than ``buffer_batches``.
    """

    enabled: bool = False
    """Publish events (off by default: nothing listens unless a router is deployed)."""
    endpoint: str = "tcp://127.0.0.1:5557"
    """ZMQ PUB address to bind (``tcp://host:port``, ``ipc://path``); port 0 picks a free one."""
    replay_endpoint: str | None = "tcp://127.0.0.1:5558"
    """ZMQ ROUTER address to bind for replay and full-report requests; ``null``: none (lost events stay lost)."""
    replica_id: str | None = None
    """This replica's name in the router's index and logs; ``null``: ``<hostname>:<pid>``."""
    topic: str = ""
    """Topic frame of every message (vLLM's default is empty)."""
    buffer_batches: int = Field(10_000, gt=0, le=10_000_000)
    """Batches kept for replay; older ones are recovered with a full report."""
    interval_s: float = Field(0.05, gt=0, le=60)
    """How often the store's event queue is drained and published."""
    heartbeat_s: float | None = Field(1.0, gt=0, le=3600)
    """After this many seconds with nothing to publish, an empty batch: its seq tells a router that missed
    batches or a whole restart that it is behind (it then replays or asks for a full report) without
    waiting for the next real event; ``null``: never (vLLM's publisher sends none)."""

    report_interval_s: float = Field(1.0, ge=0, le=3600)
    """A full report (every key held, per tier) is built at most once per this many seconds; report requests
    in between get the last one, as of its seq (the router replays the batches after it), so a flood of
    requests on the replay endpoint costs one report per interval. ``0``: build one for every request."""

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _zmq_address(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(_SCHEMES):
            raise ValueError(f"{value!r} is not a ZMQ address: use tcp://host:port or ipc://path")
        return value


def events_override(cfg: EventsConfig, endpoint: str | None, replay_endpoint: str | None,
                    **fields: Any) -> EventsConfig:
    """``cfg`` with the command line's ``--events-endpoint`` / ``--replay-endpoint`` (and ``fields``) applied;
    an endpoint turns events on. Raises ``ValueError`` naming the flags and what is wrong with them."""
    overrides: dict[str, Any] = dict(fields)
    if endpoint is not None:
        overrides.update(enabled=True, endpoint=endpoint)
    if replay_endpoint is not None:
        overrides["replay_endpoint"] = replay_endpoint
    try:
        return type(cfg).model_validate({**cfg.model_dump(), **overrides})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"--events-endpoint/--replay-endpoint: {problems}") from None
