"""Recompute ``data/smollm2_reference.json``: transformers' reading of the default GGUF model.

The suite compares the engine with this file instead of running transformers
live, because transformers needs minutes here to parse and dequantize the
GGUF (its metadata reader makes several numpy views per vocabulary string).
Nothing in it comes from this repository's code: transformers' tokenizer,
chat template rendering, GGUF dequantization and Llama forward pass produce
every number. Run from the checkout root after changing the model package::

    .venv/bin/python tests/engine/gguf_reference.py
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

REFERENCE = Path(__file__).parent / "data" / "smollm2_reference.json"
CHAT_PROMPTS = ["What is the capital of France?", "Name three primary colors."]
RAW_PROMPTS = ["The quick brown fox jumps over the lazy dog. The dog"]
NEW_TOKENS = 12
TOKENIZER_STRINGS = [
    "Hello, world!",
    "In 2024, 12345 apples cost $3.50 (about €3.21).",
    "  leading spaces,\ttabs\nand newlines\n\n",
    "<|im_start|>user\nhi<|im_end|>",
    "naïve café, 東京, emoji 🙂",
]


def file_digest(path: Path) -> str:
    """SHA-256 of the whole file: which GGUF the reference was computed on."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from engine.default_model import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
               for p in CHAT_PROMPTS] + RAW_PROMPTS
    cases = []
    for text in prompts:
        ids = tok(text, add_special_tokens=True).input_ids
        out = list(ids)
        with torch.no_grad():
            for _ in range(NEW_TOKENS):  # plain greedy, no stop on EOS, full recompute each step
                out.append(int(model(torch.tensor([out])).logits[0, -1].argmax()))
        cases.append({"prompt": text, "prompt_ids": ids, "greedy_ids": out[len(ids):]})
    strings = [{"text": s, "ids": tok(s, add_special_tokens=True).input_ids} for s in TOKENIZER_STRINGS]
    data = {"gguf": path.name, "sha256": file_digest(path), "transformers": transformers.__version__,
            "chat_prompts": CHAT_PROMPTS, "raw_prompts": RAW_PROMPTS, "cases": cases, "tokenizer": strings}
    REFERENCE.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {REFERENCE}")


if __name__ == "__main__":
    main()
