"""End to end on loopback: 3 ``kvstore engine serve`` replicas (built-in model) behind ``kvstore route``.

One fleet for the module (starting processes is most of the time), tests in
an order that leaves it usable: the multi-turn workload first, then lost
events (r1: replayed), a stale index (r2 keeps one batch, so it recovers from
the full report), a restart (r0) and a replica down (r2, last). The router
follows r1 and r2 through :class:`~route_fleet.Forwarder` so batches can be
dropped. Each check of "the router knows" polls ``POST /route`` with a
deadline: events travel asynchronously (a replica publishes every 50 ms).
What proves routing is the replicas' own ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from route_fleet import Forwarder, Proc, Replica, restart_replica, start_replicas, start_router

BS = 4
TEMPLATE_BLOCKS = 2
"""Blocks every first user turn shares: BOS and the fallback template's ``<|user|>\n`` (10 tokens)."""
ROUTED = "x-kvstore-routed-to"
DEADLINE_S = 30.0


@dataclass
class Fleet:
    cwd: Path
    replicas: dict[str, Replica]
    configs: dict[str, Path]
    forwarders: dict[str, Forwarder]
    router: Proc
    url: str


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    cwd = tmp_path_factory.mktemp("fleet")
    configs = {}
    for name in ("r0", "r1", "r2"):
        # Host RAM only: a restarted replica starts empty. r2 buffers one batch for replay.
        buffer = "\nevents:\n  buffer_batches: 1\n" if name == "r2" else ""
        configs[name] = cwd / f"{name}.yaml"
        configs[name].write_text(f"tiers: [host]\nhost:\n  capacity: 8MiB\n{buffer}")
    replicas = {r.name: r for r in start_replicas(["r0", "r1", "r2"], cwd, BS, configs)}
    forwarders = {n: Forwarder(replicas[n].events) for n in ("r1", "r2")}
    events = {"r0": replicas["r0"].events, **{n: f.endpoint for n, f in forwarders.items()}}
    router, url = start_router(cwd, list(replicas.values()), events, poll_interval=0.3)
    yield Fleet(cwd, replicas, configs, forwarders, router, url)
    router.stop()
    for f in forwarders.values():
        f.close()
    for r in replicas.values():
        r.proc.stop()


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def _chat(base: str, messages: list[dict[str, str]]) -> tuple[dict[str, str], Any]:
    status, headers, body = _post(f"{base}/v1/chat/completions",
                                  {"model": "builtin", "messages": messages, "max_tokens": 4, "temperature": 0})
    assert status == 200, body
    return headers, body


def _cached(body: Any) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def _next_turn(messages: list[dict[str, str]], answer: Any, text: str) -> list[dict[str, str]]:
    return [*messages, {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
            {"role": "user", "content": text}]


def _wait_route(fleet: Fleet, messages: list[dict[str, str]], ok: Callable[[Any], bool]) -> Any:
    """Poll ``POST /route`` until ``ok(answer)``; fail with the last answer and the router's metrics."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        status, _, answer = _post(f"{fleet.url}/route", {"messages": messages})
        if status == 200 and ok(answer):
            return answer
        if time.monotonic() > deadline:
            _, _, metrics = _get(f"{fleet.url}/stats")
            raise AssertionError(f"/route never satisfied the check; last answer {answer}; metrics {metrics}")
        time.sleep(0.05)


def _until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _get(url: str) -> tuple[int, dict[str, str], Any]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return resp.status, dict(resp.headers), json.loads(resp.read())


def _feed(fleet: Fleet, name: str) -> dict[str, Any]:
    return _get(f"{fleet.url}/stats")[2]["events"]["replicas"][name]


def _seed(fleet: Fleet, name: str, text: str) -> tuple[list[dict[str, str]], int]:
    """A one-turn history sent straight to replica ``name`` (the router learns of it only from events):
    the follow-up turn's messages and how many blocks of it ``name`` holds."""
    messages = [{"role": "user", "content": text}]
    headers, answer = _chat(fleet.replicas[name].url, messages)
    assert headers["x-kvstore-replica"] == name
    return _next_turn(messages, answer, "And then?"), answer["usage"]["prompt_tokens"] // BS


def test_each_later_turn_goes_to_the_replica_holding_its_history(fleet: Fleet) -> None:
    chats = [[{"role": "user", "content": f"Conversation {i}: tell me about the river number {i}."}]
             for i in range(6)]
    with ThreadPoolExecutor(len(chats)) as pool:  # first turns at once: the load term spreads them
        firsts = list(pool.map(lambda m: _chat(fleet.url, m), chats))
    home = [headers[ROUTED] for headers, _ in firsts]
    assert len(set(home)) >= 2, home
    answers = [body for _, body in firsts]
    # Only the template's and the shared words' blocks can be cached yet ("<|user|>\nConversation ").
    assert all(_cached(a) <= 5 * BS for a in answers)
    for turn in (2, 3):
        for i in range(len(chats)):
            held = answers[i]["usage"]["prompt_tokens"] // BS  # full blocks of the previous prompt
            chats[i] = _next_turn(chats[i], answers[i], f"Turn {turn}: and what lives in river {i}?")
            _wait_route(fleet, chats[i], lambda a: a["hit_blocks"] >= held)
            headers, answers[i] = _chat(fleet.url, chats[i])
            assert headers[ROUTED] == headers["x-kvstore-replica"] == home[i]
            assert _cached(answers[i]) >= held * BS  # the replica did not recompute the history
            assert int(headers["x-kvstore-hit-blocks"]) >= held
    metrics = _get(f"{fleet.url}/stats")[2]
    assert metrics["decisions"] >= 18 and metrics["retries"] == 0 and metrics["hit_blocks"] > 0


def test_lost_events_are_replayed(fleet: Fleet) -> None:
    before = _feed(fleet, "r1")
    fleet.forwarders["r1"].drop_next(1)
    follow_up, held = _seed(fleet, "r1", "Lost events: a history only replica r1 has seen.")
    # Only after the drop: the next request's batches must come later, or they could be dropped with it.
    _until(lambda: bool(fleet.forwarders["r1"].dropped), "the forwarder to drop a batch")
    _seed(fleet, "r1", "Another request on r1, whose batches reveal the gap.")
    answer = _wait_route(fleet, follow_up, lambda a: a["replica"] == "r1" and a["hit_blocks"] >= held)
    assert answer["hit_by_tier"]["gpu"] >= 1
    after = _feed(fleet, "r1")
    assert after["lost_batches"] > before["lost_batches"] and after["replays"] > before["replays"]
    headers, body = _chat(fleet.url, follow_up)
    assert headers[ROUTED] == "r1" and _cached(body) >= held * BS


def test_a_stale_index_recovers_from_the_full_report(fleet: Fleet) -> None:
    before = _feed(fleet, "r2")
    fleet.forwarders["r2"].drop_next(1)
    follow_up, held = _seed(fleet, "r2", "Stale index: r2 keeps one batch, so this one cannot be replayed.")
    # Only after the drop: the next request's batches must come later, or they could be dropped with it.
    _until(lambda: bool(fleet.forwarders["r2"].dropped), "the forwarder to drop a batch")
    _seed(fleet, "r2", "Another request on r2, whose batches reveal the gap.")
    _wait_route(fleet, follow_up, lambda a: a["replica"] == "r2" and a["hit_blocks"] >= held)
    after = _feed(fleet, "r2")
    assert after["full_reports"] > before["full_reports"]
    headers, body = _chat(fleet.url, follow_up)
    assert headers[ROUTED] == "r2" and _cached(body) >= held * BS


def test_a_restarted_replica_is_forgotten(fleet: Fleet) -> None:
    follow_up, held = _seed(fleet, "r0", "Restart: a history on r0 that dies with it.")
    _wait_route(fleet, follow_up, lambda a: a["replica"] == "r0" and a["hit_blocks"] >= held)
    old = fleet.replicas["r0"]
    old.proc.stop(signal.SIGTERM)
    fleet.replicas["r0"] = restart_replica(old, fleet.cwd, BS, fleet.configs["r0"])
    _seed(fleet, "r0", "A first request on the restarted r0.")
    # Nobody holds the history now (beyond the template's blocks): the router must not believe r0 still does.
    # (r0 is back up, and its cost is the whole prompt but the template's blocks: it holds none of the history.)
    _wait_route(fleet, follow_up, lambda a: a["costs"].get("r0", 0) >= a["prompt_blocks"] - TEMPLATE_BLOCKS)
    headers, body = _chat(fleet.url, follow_up)
    assert _cached(body) <= TEMPLATE_BLOCKS * BS
    feed = _feed(fleet, "r0")
    assert feed["restarts"] + feed["backwards"] + feed["full_reports"] >= 1


def test_a_replica_that_is_down_gets_no_traffic(fleet: Fleet) -> None:
    follow_up, held = _seed(fleet, "r2", "Down: a history on r2, which is about to be killed.")
    _wait_route(fleet, follow_up, lambda a: a["replica"] == "r2" and a["hit_blocks"] >= held)
    fleet.replicas["r2"].proc.stop(signal.SIGKILL)
    served = []
    for i in range(4):
        headers, body = _chat(fleet.url, _next_turn(follow_up, {"choices": [{"message": {"content": str(i)}}]},
                                                     f"Still there? {i}"))
        served.append(headers[ROUTED])
        if i == 0:  # the history died with r2: another replica computed it (later ones may find it there)
            assert _cached(body) <= TEMPLATE_BLOCKS * BS
    assert "r2" not in served
    replicas = _get(f"{fleet.url}/stats")[2]["replicas"]
    assert replicas["r2"]["up"] is False and replicas["r2"]["reason"]
