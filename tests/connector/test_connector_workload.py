"""A multi-turn chat workload larger than GPU + host: correct outputs, counters that add up, swap preemption."""

from __future__ import annotations

from pathlib import Path

from connlib import GREEDY, embedded, make_llm, prompt

SYSTEM = prompt(7, 24)


def _conversations(users: int, turns: int) -> list[list[list[int]]]:
    """Per user, the prompt of each turn: system prompt + history + a new question (outputs appended later)."""
    return [[prompt(100 * u + t, 9 + (u + t) % 5) for t in range(turns)] for u in range(users)]


def _run_chat(llm, questions, salt_of=lambda u: None):  # noqa: ANN001, ANN202
    """Run turn by turn (all users per turn in one batch); returns per user the list of outputs."""
    history = [list(SYSTEM) for _ in questions]
    outs: list[list] = [[] for _ in questions]
    for t in range(len(questions[0])):
        prompts = []
        for u, qs in enumerate(questions):
            history[u] += qs[t]
            prompts.append(list(history[u]))
        results = []
        for u, p in enumerate(prompts):
            results.append(llm.add_request(p, GREEDY, cache_salt=salt_of(u)))
        while llm.has_unfinished():
            llm.step()
        from engine.outputs import RequestOutput

        for u, seq in enumerate(results):
            out = RequestOutput.from_sequence(seq)
            outs[u].append(out)
            history[u] += out.token_ids
    return outs


def test_workload_larger_than_gpu_and_host(tmp_path: Path) -> None:
    questions = _conversations(users=5, turns=3)
    reference = _run_chat(make_llm(None, gpu_blocks=64), questions)
    # GPU 40 blocks, host 12 blocks; the conversations need far more (about 5 x 18 blocks by the last turn).
    llm = make_llm(tmp_path, gpu_blocks=40, host_blocks=12, write="write_back")
    got = _run_chat(llm, questions)
    embedded(llm).store.check_integrity()  # internals
    by_tier = {"gpu": 0, "host": 0, "disk": 0}
    for u in range(len(questions)):
        for t in range(3):
            out, ref = got[u][t], reference[u][t]
            assert out.token_ids == ref.token_ids, f"user {u} turn {t}"
            m = out.metrics
            assert sum(m.cached_tokens_by_tier.values()) == m.num_cached_tokens
            if m.num_preemptions == 0:
                assert m.num_cached_tokens + m.num_prefill_tokens_computed == m.num_prompt_tokens
            for k, v in m.cached_tokens_by_tier.items():
                by_tier[k] += v
    assert by_tier["gpu"] > 0 and by_tier["host"] + by_tier["disk"] > 0, by_tier
    st = embedded(llm).stats()
    assert st["gpu"]["evictions"] > 0 and st["disk"]["num_blocks"] > 0


def test_swap_preemption_reloads_instead_of_recomputing(tmp_path: Path) -> None:
    prompts = [SYSTEM + prompt(500 + i, 20) for i in range(6)]
    params = GREEDY.__class__(max_tokens=24, temperature=0.0)
    reference = make_llm(None, gpu_blocks=128).generate(prompts, params)
    llm = make_llm(tmp_path, gpu_blocks=26, host_blocks=64, write="write_back", preemption="swap")
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    preempted = [o for o in outs if o.metrics.num_preemptions]
    assert preempted, "the tiny pool should force preemption"
    # A swapped-out sequence comes back from the cache: each readmission recomputes at most its partial last block.
    for o in preempted:
        m = o.metrics
        assert m.num_cached_tokens > 0
        assert m.num_prefill_tokens_computed <= m.num_prompt_tokens + m.num_preemptions * 4
    embedded(llm).store.check_integrity()  # internals
    assert embedded(llm).stats()["host"]["spilled_blocks"] > 0  # the swap-out wrote to the host tier
    # The plain engine on the same tiny pool recomputes everything after a preemption: far more prefill.
    plain = make_llm(None, gpu_blocks=26)
    outs_r = plain.generate(prompts, params)
    assert [o.token_ids for o in outs_r] == [r.token_ids for r in reference]
    assert any(o.metrics.num_preemptions for o in outs_r)
    swap_cost = sum(o.metrics.num_prefill_tokens_computed for o in outs)
    recompute_cost = sum(o.metrics.num_prefill_tokens_computed for o in outs_r)
    assert swap_cost < recompute_cost
