"""The README's fleet set-up (``configs/fleet/``) run as written: one Redis, two hosts (a daemon and an engine
replica each, on loopback, standing for two machines) and ``kvstore route`` in front.

Only what cannot be the same on one machine changes: ports, the two hosts' data directories and sockets
(``KVSTORE_*`` overrides, as the block's comment says for the Redis address), a 256 MiB arena instead of 8 GiB.
A chat's later turn goes to the host holding its history; with that host's engine killed, the other host
answers it with the history loaded from Redis through its own daemon (its ``cached_tokens``), never having
seen the chat, and equal to what the first host answered before.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "daemon"))

from daemonlib import free_port, short_tmpdir  # noqa: E402
from benchmarks.redis_servers import redis_missing  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
HOSTS = ("host-a", "host-b")


def fleet_block() -> list[str]:
    """The commands of the README's ``# fleet:`` block (continuations joined, comments dropped)."""
    m = re.search(r"```bash\n# fleet:[^\n]*\n(.*?)```", README.read_text(), re.S)
    assert m, "README.md has no ```bash block starting '# fleet:'"
    lines = m.group(1).replace("\\\n", " ").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]


def argv_of(command: str) -> list[str]:
    words = shlex.split(command)
    if words[-1] == "&":  # run in the background: here every process is a child the fixture stops
        words = words[:-1]
    if words[0] == ".venv/bin/kvstore":
        return [sys.executable, "-m", "kvstore", *words[1:]]
    return words


class Fleet:
    def __init__(self) -> None:
        self.root = short_tmpdir()
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.logs: dict[str, Path] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        log = self.root / f"{name}.log"
        proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.procs[name], self.logs[name] = proc, log
        return proc

    def wait_line(self, name: str, pattern: str, timeout: float = 180.0) -> re.Match[str]:
        proc = self.procs[name]
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            if m := re.search(pattern, line):
                return m
        raise AssertionError(f"{name}: no line matching {pattern!r}:\n{self.logs[name].read_text()[-3000:]}")

    def close(self) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        import shutil

        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Fleet, str, dict[str, subprocess.Popen[str]]]]:
    if (why := redis_missing()) is not None:
        pytest.fail(f"the fleet test needs redis-server: {why} (scripts/ensure_redis.sh installs it)")
    redis_cmd, serve_cmd, engine_cmd, route_cmd = fleet_block()
    f = Fleet()
    try:
        rport = free_port()
        (f.root / "redis").mkdir()
        f.start("redis", [*argv_of(redis_cmd), "--port", str(rport), "--dir", str(f.root / "redis")])
        url = f"redis://127.0.0.1:{rport}/0"
        ports: dict[str, tuple[int, int, int]] = {}
        engines: dict[str, subprocess.Popen[str]] = {}
        for host in HOSTS:
            home = f.root / host
            home.mkdir()
            env = {"KVSTORE_REMOTE__URL": url, "KVSTORE_DISK__PATH": str(home / "lmdb"),
                   "KVSTORE_DAEMON__SOCKET_PATH": str(home / "d.sock"), "KVSTORE_METRICS__PORT": "0",
                   "KVSTORE_HOST__CAPACITY": "256MiB"}
            f.start(f"{host}-daemon", argv_of(serve_cmd), env)
            f.wait_line(f"{host}-daemon", r"listening on unix:")
            port, ev, rp = free_port(), free_port(), free_port()
            ports[host] = (port, ev, rp)
            cmd = engine_cmd.replace("8000", str(port)).replace("5557", str(ev)).replace("5558", str(rp))
            engines[host] = f.start(host, argv_of(cmd.replace("host-a", host)), env)
        for host in HOSTS:
            f.wait_line(host, r"listening on http://")
        cmd = route_cmd.replace("--port 8080", "--port 0")
        for host, (port, ev, rp) in ports.items():
            cmd = (cmd.replace(f"{host}:8000", f"127.0.0.1:{port}").replace(f"{host}:5557", f"127.0.0.1:{ev}")
                   .replace(f"{host}:5558", f"127.0.0.1:{rp}"))
        f.start("router", argv_of(cmd))
        router = f.wait_line("router", r"behind (http://[\d.:]+)").group(1)
        yield f, router, engines
    finally:
        f.close()


def chat(router: str, messages: list[dict[str, str]]) -> tuple[dict[str, Any], str]:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    req = urllib.request.Request(router + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read()), r.headers["x-kvstore-routed-to"]


def cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))


def test_the_readme_fleet_routes_turns_home_and_a_lost_host_is_replaced_from_redis(fleet: Any) -> None:
    f, router, engines = fleet
    notes = "".join(f"Note {i}: item {i * 7} costs {i * 13 % 97} coins and weighs {i * 5 % 41} kg.\n" for i in range(40))
    messages = [{"role": "user", "content": "Summarise these notes.\n" + notes}]
    first, home = chat(router, messages)
    assert cached(first) == 0
    time.sleep(1.0)  # the engine's events reach the router; the daemon's write-through reaches Redis
    again, routed = chat(router, messages)
    assert routed == home and cached(again) >= first["usage"]["prompt_tokens"] // 16 * 16 - 16  # its own cache
    engines[home].kill()  # the host holding the chat is gone
    engines[home].wait(30)
    other = next(h for h in HOSTS if h != home)
    answer, routed = chat(router, messages)
    assert routed == other
    group_tokens = 8 * 16  # remote.group_blocks x the engine's block size: only full groups go to Redis
    assert cached(answer) >= (first["usage"]["prompt_tokens"] // 16) // 8 * group_tokens > 0  # from Redis
    assert answer["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
