"""The byte tokenizer, and a checkpoint's tokenizer.json picked up through ``tokenizers``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, EngineConfig, ModelArch, SamplingParams
from engine.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from engine.weights import build_model, init_random, save_checkpoint


def test_byte_tokenizer_round_trips_utf8() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    assert ids[0] == ByteTokenizer.BOS and ids[1:3] == [104, 0xC3]
    assert tok.decode(ids + [ByteTokenizer.EOS]) == "héllo ✓"


def test_byte_tokenizer_needs_room_in_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="at least 258, the model has 100"):
        load_tokenizer(None, 100)


def test_checkpoint_tokenizer_json_is_used(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "again": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.decoder = tokenizers.decoders.WordPiece()
    tok.save(str(tmp_path / "tokenizer.json"))
    model = build_model(ModelArch.tiny(vocab_size=16), torch.float32, "cpu")
    init_random(model, 0)
    save_checkpoint(model, tmp_path)
    llm = LLM(tmp_path, config=EngineConfig(block_size=4, num_gpu_blocks=16, dtype="float32"))
    assert isinstance(llm.tokenizer, HFTokenizer)
    (out,) = llm.generate("hello world", SamplingParams(max_tokens=3, ignore_eos=True))
    assert out.prompt_token_ids == [1, 2]
    assert out.text == llm.tokenizer.decode(out.token_ids)
