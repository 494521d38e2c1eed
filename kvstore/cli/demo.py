"""A multi-turn chat workload on the default model (or the built-in tiny one), served through kvstore's tiers.

Several users share a system prompt and talk for several turns; each turn's
prompt is the whole conversation so far. The GPU pool and host tier are kept
small on purpose, so later turns find their history on the GPU, in host RAM
and on disk, and the per-turn table shows where the cached tokens came from.
Beside each turn's time to first token it shows the same prompts' time on
the same model without a cache (a second engine, prefill only), so the gain
is read off one table.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from kvstore.config import KVStoreConfig

if TYPE_CHECKING:
    from engine import LLM, EngineConfig

SYSTEM_PROMPT = (
    "You are a helpful assistant for an infrastructure team. Answer briefly and precisely, "
    "cite the relevant configuration field when you can, and say so when you do not know. "
)
QUESTIONS = (
    "How big should the host tier be?",
    "What happens when the disk cap is reached?",
    "Which write policy should we use for chat?",
    "Why did time to first token drop on the second turn?",
    "Can two tenants share a cached prefix?",
    "How do I check the hit rate per tier?",
)


@dataclass(frozen=True)
class TurnReport:
    """Aggregate of one turn over all users."""

    turn: int
    prompt_tokens: int
    ttft_ms_mean: float
    cached: dict[str, int]
    computed: int
    answers: tuple[tuple[str, str], ...] = ()
    """``(question, answer)`` per user."""
    ttft_ms_no_cache: float | None = None
    """The same prompts' mean time to first token on the same model with no prefix cache."""
    prompts: tuple[list[int] | str, ...] = ()
    """Each user's prompt of the turn (for the no-cache baseline)."""


def demo_engine_config(cfg: KVStoreConfig, gpu_blocks: int, users: int) -> EngineConfig:
    """The engine settings of the demo: ``cfg``'s block size, a GPU pool of ``gpu_blocks``, a batch of ``users``."""
    from engine import EngineConfig

    return EngineConfig(block_size=cfg.model.block_size, num_gpu_blocks=gpu_blocks, max_num_batched_tokens=256,
                        max_num_seqs=users)


def run_demo(cfg: KVStoreConfig, users: int, turns: int, gpu_blocks: int, max_tokens: int,
             progress: bool = True, model: str | Path | None = None) -> list[TurnReport]:
    """Run the workload on ``model`` (``LLM``'s argument; ``None`` is the tiny random model) with the connector
    ``cfg`` names (its data paths already set, see ``kvstore demo``); returns one report per turn. A model with
    a chat template gets each conversation rendered through it."""
    from connectors import build_connector
    from engine import LLM, SamplingParams
    from engine.chat_template import Message
    from engine.outputs import RequestOutput

    connector = build_connector(cfg)
    llm = LLM(model, config=demo_engine_config(cfg, gpu_blocks, users), connector=connector)
    _warm_up(llm)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    histories = [SYSTEM_PROMPT for _ in range(users)]
    chats: list[list[Message]] = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in range(users)]
    reports: list[TurnReport] = []
    bar = tqdm(total=users * turns * max_tokens, desc="demo (generated tokens)", unit="tok", disable=not progress)
    try:
        for t in range(turns):
            seqs, prompts = [], []
            questions = [QUESTIONS[(u + t) % len(QUESTIONS)] for u in range(users)]
            for u in range(users):
                histories[u] += f"\nUser {u}: {questions[u]}\nAssistant:"
                chats[u].append({"role": "user", "content": questions[u]})
                prompts.append(llm.chat_template.render(chats[u]) if llm.chat_template is not None else histories[u])
                seqs.append(llm.add_request(prompts[-1], params))
            shown = 0
            while llm.has_unfinished():
                llm.step()
                generated = sum(len(s.output_token_ids) for s in seqs)
                bar.update(generated - shown)  # every step moves the bar, not only finished requests
                shown = generated
            bar.update(max_tokens * users - shown)  # requests that stopped early (EOS) count as done
            outs = [RequestOutput.from_sequence(s) for s in seqs]
            for u, out in enumerate(outs):
                histories[u] += out.text
                chats[u].append({"role": "assistant", "content": out.text})
            cached = {k: sum(o.metrics.cached_tokens_by_tier[k] for o in outs) for k in ("gpu", "host", "disk")}
            reports.append(TurnReport(
                turn=t + 1,
                prompt_tokens=sum(o.metrics.num_prompt_tokens for o in outs),
                ttft_ms_mean=1000 * statistics.mean(o.metrics.time_to_first_token or 0.0 for o in outs),
                cached=cached,
                computed=sum(o.metrics.num_prefill_tokens_computed for o in outs),
                answers=tuple(zip(questions, (o.text.strip() for o in outs))),
                prompts=tuple(prompts),
            ))
            # Between turns the users "think": the engine serves others, and their blocks cool down a tier.
            connector.offload("gpu" if t % 2 == 0 else "host")
    finally:
        bar.close()
        connector.close()
    return _with_no_cache_ttft(reports, model, demo_engine_config(cfg, gpu_blocks, users))


WARM_UP_SALT = "kvstore-demo-warm-up"
"""The warm-up request's cache salt: its blocks share nothing with the chats'."""


def _warm_up(llm: LLM) -> None:
    """One short request first, so neither engine's first timed turn pays one-time costs (first kernels,
    allocator growth); under its own salt, so it caches nothing the chats could hit."""
    from engine import SamplingParams

    llm.generate([SYSTEM_PROMPT], SamplingParams(max_tokens=2, temperature=0.0), cache_salt=WARM_UP_SALT)


def _with_no_cache_ttft(reports: list[TurnReport], model: str | Path | None, config: EngineConfig) -> list[TurnReport]:
    """``reports`` with each turn's prompts timed again on the same model without a prefix cache (one token
    each: the time to first token is the whole prefill)."""
    import dataclasses

    from engine import LLM, SamplingParams
    from engine.outputs import RequestOutput

    llm = LLM(model, config=config)
    _warm_up(llm)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    out = []
    for r in reports:
        seqs = [llm.add_request(p, one) for p in r.prompts]
        while llm.has_unfinished():
            llm.step()
        ttfts = [RequestOutput.from_sequence(s).metrics.time_to_first_token or 0.0 for s in seqs]
        out.append(dataclasses.replace(r, ttft_ms_no_cache=1000 * statistics.mean(ttfts)))
    return out


def format_reports(reports: list[TurnReport]) -> str:
    """The per-turn table the demo prints: where cached tokens came from, and TTFT with and without the cache."""
    head = (f"{'turn':>4} {'prompt tok':>10} {'gpu tok':>8} {'host tok':>8} {'disk tok':>8} {'computed':>8} "
            f"{'TTFT ms':>8} {'no cache':>8} {'speedup':>7}")
    lines = [head, "-" * len(head)]
    for r in reports:
        base = r.ttft_ms_no_cache
        speed = f"{base / r.ttft_ms_mean:>6.1f}x" if base and r.ttft_ms_mean else f"{'-':>7}"
        lines.append(f"{r.turn:>4} {r.prompt_tokens:>10} {r.cached['gpu']:>8} {r.cached['host']:>8} "
                     f"{r.cached['disk']:>8} {r.computed:>8} {r.ttft_ms_mean:>8.1f} "
                     f"{base if base is not None else float('nan'):>8.1f} {speed}")
    return "\n".join(lines)


def format_answers(reports: list[TurnReport]) -> str:
    """Each turn's questions and the model's answers."""
    return "\n".join(f"turn {r.turn}, user {u}: {q}\n    {a}" for r in reports for u, (q, a) in enumerate(r.answers))
