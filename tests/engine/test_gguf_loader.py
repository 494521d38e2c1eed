"""GGUF loading on small files written here the way llama.cpp's converter writes them, checked against
transformers on the same weights and against the ``gguf`` package's own reader."""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from engine import LLM, CheckpointError, EngineConfig, SamplingParams  # noqa: E402
from engine.gguf_file import GGUFFile  # noqa: E402
from engine.gguf_loader import unpermute_rows  # noqa: E402
from engine.gguf_tokenizer import tokenizer_from_gguf  # noqa: E402
from engine.model import dense_logits  # noqa: E402
from engine.model_id import checkpoint_identity  # noqa: E402
from kvstore.cli import demo_cmd  # noqa: E402
from kvstore.cli.demo import QUESTIONS  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|im_start|>", "<|im_end|>"]


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 bytes, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling, extra = {}, 0
    for b in range(256):
        if b in printable:
            spelling[b] = chr(b)
        else:
            spelling[b] = chr(256 + extra)
            extra += 1
    return [spelling[b] for b in range(256)]


VOCAB = [*byte_alphabet(), "he", "Ġw", *SPECIALS]  # 260 tokens
MERGES = ["h e", "Ġ w"]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """The row reordering of q/k projections in llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_llama(tied: bool) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=len(VOCAB), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
                                   tie_word_embeddings=tied)
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def write_gguf(path: Path, model: torch.nn.Module, tied: bool) -> Path:
    """``model`` as llama.cpp's converter would write it: llama.* metadata, BPE tokenizer, permuted q/k."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(len(VOCAB))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(VOCAB)
    w.add_token_types([3 if t in SPECIALS else 1 for t in VOCAB])
    w.add_token_merges(MERGES)
    w.add_bos_token_id(VOCAB.index("<|im_start|>"))
    w.add_eos_token_id(VOCAB.index("<|im_end|>"))
    w.add_chat_template(CHATML)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not tied:
        names["lm_head.weight"] = "output.weight"
    for i in range(cfg.num_hidden_layers):
        hf, ll = f"model.layers.{i}.", f"blk.{i}."
        names.update({hf + "input_layernorm.weight": ll + "attn_norm.weight",
                      hf + "self_attn.q_proj.weight": ll + "attn_q.weight",
                      hf + "self_attn.k_proj.weight": ll + "attn_k.weight",
                      hf + "self_attn.v_proj.weight": ll + "attn_v.weight",
                      hf + "self_attn.o_proj.weight": ll + "attn_output.weight",
                      hf + "post_attention_layernorm.weight": ll + "ffn_norm.weight",
                      hf + "mlp.gate_proj.weight": ll + "ffn_gate.weight",
                      hf + "mlp.up_proj.weight": ll + "ffn_up.weight",
                      hf + "mlp.down_proj.weight": ll + "ffn_down.weight"})
    for hf_name, ll_name in names.items():
        t = sd[hf_name]
        if ll_name.endswith("attn_q.weight"):
            t = llama_cpp_permute(t, cfg.num_attention_heads)
        elif ll_name.endswith("attn_k.weight"):
            t = llama_cpp_permute(t, cfg.num_key_value_heads)
        w.add_tensor(ll_name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model = hf_llama(tied=request.param)
    return model, write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", model, tied=request.param)


def test_logits_and_greedy_tokens_match_transformers(checkpoint) -> None:
    hf_model, path = checkpoint
    llm = LLM(path, config=EngineConfig(block_size=4, num_gpu_blocks=32, dtype="float32", device="cpu"))
    cfg = llm.arch
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (2, 4, 2, 16, 260)
    assert cfg.tie_word_embeddings == hf_model.config.tie_word_embeddings
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.max_position_embeddings) == (50000.0, pytest.approx(1e-5), 512)
    tokens = [5, 77, 256, 3, 200, 258, 41, 9, 120]
    with torch.no_grad():
        expect = hf_model(torch.tensor([tokens])).logits[0].float()
    torch.testing.assert_close(dense_logits(llm.model, tokens), expect, atol=1e-4, rtol=1e-4)
    ids = list(tokens)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    (out,) = llm.generate([tokens], SamplingParams(max_tokens=6, ignore_eos=True))
    assert out.token_ids == ids[len(tokens):]


def test_tokenizer_and_chat_template_come_from_the_metadata(checkpoint) -> None:
    _, path = checkpoint
    llm = LLM(path, config=EngineConfig(block_size=4, num_gpu_blocks=32, device="cpu"))
    he, gw, start, end = (VOCAB.index(t) for t in ("he", "Ġw", "<|im_start|>", "<|im_end|>"))
    # Merges apply, a leading space is the byte-level "Ġ", control tokens match whole; no BOS (not asked for).
    assert llm.tokenizer.encode("hello world") == [he, VOCAB.index("l"), VOCAB.index("l"), VOCAB.index("o"), gw,
                                                   *(VOCAB.index(c) for c in "orld")]
    assert llm.tokenizer.encode("<|im_start|>he<|im_end|>") == [start, he, end]
    assert llm.tokenizer.decode([start, he, gw, end]) == "he w"
    assert llm.eos_token_ids == (end,)
    assert llm.chat_template is not None
    assert llm.chat_template.user_prompt("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_header_and_tensors_agree_with_the_gguf_package(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "q.gguf"), arch="llama")
    w.add_uint32("test.u32", 7)
    w.add_float64("test.f64", 0.25)
    w.add_bool("test.flag", True)
    w.add_array("test.strings", ["a", "ß", ""])
    w.add_array("test.ints", [1, -2, 3])
    rng = np.random.default_rng(0)
    f32 = rng.standard_normal((3, 64)).astype(np.float32)
    w.add_tensor("plain", f32)
    for qtype in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.F16):
        w.add_tensor(qtype.name, gguf.quants.quantize(rng.standard_normal((5, 64)).astype(np.float32), qtype),
                     raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, ref = GGUFFile(tmp_path / "q.gguf"), gguf.GGUFReader(tmp_path / "q.gguf")
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == pytest.approx(field.contents()), key
    assert ours.metadata["test.strings"] == ["a", "ß", ""]
    assert [t.name for t in ref.tensors] == list(ours.tensors)
    for t in ref.tensors:
        expect = gguf.quants.dequantize(t.data, t.tensor_type)
        np.testing.assert_array_equal(ours.tensor(t.name), expect)
    np.testing.assert_array_equal(ours.tensor("plain"), f32)


def test_unpermute_inverts_the_converter() -> None:
    w = np.arange(6 * 8 * 3, dtype=np.float32).reshape(6 * 8, 3)
    np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(w, 6), 6), w)
    assert not np.array_equal(llama_cpp_permute(w, 6), w)


def test_identity_follows_the_file_not_its_path(checkpoint, tmp_path: Path) -> None:
    _, path = checkpoint
    copy = tmp_path / "elsewhere" / path.name
    copy.parent.mkdir()
    shutil.copy(path, copy)
    assert checkpoint_identity(copy) == checkpoint_identity(path)
    assert checkpoint_identity(path).startswith("tiny.gguf@")
    data = bytearray(copy.read_bytes())
    data[-3] ^= 0xFF  # one weight byte of the last tensor
    copy.write_bytes(bytes(data))
    assert checkpoint_identity(copy) != checkpoint_identity(path)
    llm = LLM(path, config=EngineConfig(block_size=4, num_gpu_blocks=8, device="cpu"))
    assert llm.pool.layout.model_id == checkpoint_identity(path)


def test_bad_files_get_clear_errors(checkpoint, tmp_path: Path) -> None:
    _, path = checkpoint
    with pytest.raises(CheckpointError, match="missing.gguf' does not exist"):
        LLM(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a model at all")
    with pytest.raises(CheckpointError, match=r"junk.gguf: not a GGUF file"):
        LLM(tmp_path / "junk.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"truncated.gguf: tensor '.*' ends past the end of the file"):
        LLM(truncated)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(CheckpointError, match=r"header.gguf: not a readable GGUF file"):
        LLM(header_only)


def test_other_architectures_and_tokenizers_are_refused(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "gemma.gguf"), arch="gemma")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"gemma.gguf: general.architecture 'gemma' is not supported"):
        LLM(tmp_path / "gemma.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "nolayers.gguf"), arch="llama")
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_vocab_size(300)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match=r"nolayers.gguf: metadata key 'llama.feed_forward_length' is missing"):
        LLM(tmp_path / "nolayers.gguf")
    for name, model, pre in (("spm", "llama", "default"), ("pre", "gpt2", "qwen2")):
        w = gguf.GGUFWriter(str(tmp_path / f"{name}.gguf"), arch="llama")
        w.add_tokenizer_model(model)
        w.add_tokenizer_pre(pre)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    with pytest.raises(CheckpointError, match=r"spm.gguf: tokenizer.ggml.model 'llama' is not supported"):
        tokenizer_from_gguf(GGUFFile(tmp_path / "spm.gguf"))
    with pytest.raises(CheckpointError, match=r"pre.gguf: tokenizer.ggml.pre 'qwen2' is not supported"):
        tokenizer_from_gguf(GGUFFile(tmp_path / "pre.gguf"))


def test_demo_renders_each_conversation_through_the_chat_template(checkpoint, tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    _, path = checkpoint
    parser = argparse.ArgumentParser(prog="kvstore")
    demo_cmd.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["demo", "--model", str(path), "--users", "2", "--turns", "2", "--max-tokens", "3",
                              "--disk-path", str(tmp_path / "lmdb"), "--no-progress", "--show-answers"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert f"turn 1, user 0: {QUESTIONS[0]}\n" in out and f"turn 2, user 1: {QUESTIONS[2]}\n" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["1"], ["2"])]
    prompt_tokens = {int(r[0]): int(r[1]) for r in rows}
    cached_turn2 = sum(int(x) for x in rows[1][2:5])  # gpu, host, disk tokens
    # Turn 2 re-sends turn 1's rendered conversation, so its prefix is served from the cache.
    assert prompt_tokens[2] > prompt_tokens[1] and cached_turn2 > 0
