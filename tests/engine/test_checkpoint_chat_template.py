"""A Hugging Face checkpoint directory's chat template is read where transformers (and so vLLM) reads it.

``kvstore route --model DIR`` renders chats with it to compute the block keys of vLLM replicas serving
``DIR``; with the role-tagged fallback instead, its token ids differed from vLLM's (no default system
message) and no chat ever hit.
"""

from __future__ import annotations

import json
from pathlib import Path

from engine.chat_template import chat_template_from_checkpoint
from engine.default_model import default_model_path
from engine.hf_export import export_hf
from engine.model_text import load_model_text
from engine.server.prompt import PromptRenderer
from kvstore.route.openai_request import parse_request

TEMPLATE = "{% for m in messages %}{{ bos_token }}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
MESSAGES = [{"role": "user", "content": "hi"}]


def test_the_template_comes_from_tokenizer_config_or_chat_template_jinja(tmp_path: Path) -> None:
    cfg = {"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = chat_template_from_checkpoint(tmp_path)
    assert t is not None and t.render(MESSAGES, add_generation_prompt=False) == "<s><user>hi</s>"
    (tmp_path / "chat_template.jinja").write_text("[{{ messages[0]['content'] }}]")  # transformers prefers the file
    t = chat_template_from_checkpoint(tmp_path)
    assert t is not None and t.render(MESSAGES) == "[hi]"


def test_named_templates_use_the_default_one_and_none_means_none(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain {{ messages|length }}"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    t = chat_template_from_checkpoint(tmp_path)
    assert t is not None and t.render(MESSAGES) == "plain 1"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert chat_template_from_checkpoint(tmp_path) is None


def test_the_exported_default_model_renders_chats_as_its_gguf_does(tmp_path: Path) -> None:
    out = export_hf(default_model_path(), tmp_path / "hf")
    request = parse_request("chat", {"messages": [{"role": "user", "content": "What is the capital of France?"}]})
    from_dir = PromptRenderer(load_model_text(out)).token_ids(request)
    from_gguf = PromptRenderer(load_model_text(default_model_path())).token_ids(request)
    assert from_dir == from_gguf  # the default system message included, as vLLM renders it
