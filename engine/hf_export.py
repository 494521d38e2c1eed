"""A GGUF checkpoint as a Hugging Face directory, for engines that load only that format (vLLM).

vLLM reads ``config.json``, ``*.safetensors`` and ``tokenizer.json``; the
default model ships as a llama.cpp GGUF file. :func:`export_hf` writes the
directory with the engine's own reader, so the weights (dequantized to fp32,
q/k rows put back in Hugging Face order), the tokenizer and the chat template
are exactly those kvstore's built-in engine runs, and no ``transformers`` or
``gguf``-in-``transformers`` path is needed. The result is cached: a directory
whose stamp names the same source identity is reused as it is.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from engine.config import CheckpointError
from engine.gguf_file import GGUFFile
from engine.gguf_loader import config_from_gguf, is_gguf_path, load_gguf_weights
from engine.gguf_tokenizer import tokenizer_from_gguf
from engine.model_id import checkpoint_identity
from engine.weights import build_model, save_checkpoint

STAMP = "kvstore-export.json"


def default_model_hf() -> Path:
    """The default model (SmolLM2-135M-Instruct, from its installed GGUF) as a Hugging Face directory, exported
    once into ``$XDG_CACHE_HOME/kvstore/models`` (``~/.cache`` without it) and reused from there."""
    from engine.default_model import default_model_path

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvstore" / "models"
    return export_hf(default_model_path(), cache / "SmolLM2-135M-Instruct-hf")


def export_hf(gguf_path: str | Path, out: str | Path) -> Path:
    """Write (or reuse) the Hugging Face directory of ``gguf_path`` at ``out``; returns ``out``.

    The directory is built next to ``out`` and renamed into place, so a
    reader never sees half a checkpoint, and two processes exporting at once
    both end with a whole one. Raises :class:`CheckpointError` naming the file
    when it is not a GGUF checkpoint the engine reads.
    """
    src, dest = Path(gguf_path), Path(out)
    if not is_gguf_path(src) or not src.is_file():
        raise CheckpointError(f"{src}: not a GGUF file (export_hf converts llama.cpp checkpoints)")
    identity = checkpoint_identity(src)
    if _stamp(dest) == identity:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    work.chmod(0o755)  # mkdtemp makes it private; the checkpoint is for any user of the machine
    try:
        gguf = GGUFFile(src)
        arch = config_from_gguf(gguf)
        model = build_model(arch, torch.float32, "cpu")
        load_gguf_weights(model, gguf)
        save_checkpoint(model, work)
        _write_text_side(gguf, work)
        (work / STAMP).write_text(json.dumps({"source": str(src), "identity": identity}))
        if dest.exists():
            shutil.rmtree(dest, ignore_errors=True)
        try:
            os.replace(work, dest)
        except OSError:  # another exporter won the rename: its directory is as good as ours
            if _stamp(dest) != identity:
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dest


def _stamp(directory: Path) -> str | None:
    try:
        return str(json.loads((directory / STAMP).read_text())["identity"])
    except (OSError, ValueError, KeyError):
        return None


def _write_text_side(gguf: GGUFFile, directory: Path) -> None:
    """``tokenizer.json``, ``tokenizer_config.json`` (special tokens, chat template), ``generation_config.json``."""
    tokenizer_from_gguf(gguf).save(str(directory / "tokenizer.json"))
    tokens: list[str] = gguf.require("tokenizer.ggml.tokens")
    bos, eos = (gguf.field(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos"))
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokens[bos] if bos is not None else None,
        "eos_token": tokens[eos] if eos is not None else None,
        "add_bos_token": bool(gguf.field("tokenizer.ggml.add_bos_token", False)),
        "model_max_length": int(gguf.require("llama.context_length")),
        "clean_up_tokenization_spaces": False,
    }
    template = gguf.field("tokenizer.chat_template")
    if template is not None:
        config["chat_template"] = template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    generation = {k: v for k, v in {"bos_token_id": bos, "eos_token_id": eos}.items() if v is not None}
    (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
