"""Continuous batching: exact scheduling decisions, and batched greedy output equal to solo runs."""

from __future__ import annotations

import random

from engine import LLM, EngineConfig, SamplingParams
from engine.block_manager import BlockManager
from engine.scheduler import Scheduler
from engine.sequence import SequenceState, SequenceStatus
from kvstore.store.gpu_pool import GPUBlockPool
from kvstore.layout import KVLayout


def _scheduler(num_blocks: int, budget: int, max_seqs: int = 8) -> Scheduler:
    pool = GPUBlockPool(KVLayout(1, 1, 4, 4, "float32"), num_blocks, "cpu")
    return Scheduler(BlockManager(pool), budget, max_seqs)


def _advance(sched: Scheduler) -> list[tuple[str, int, int]]:
    """Schedule one step and pretend it ran (every chunk's tokens computed; completed prompts emit token 0)."""
    plan = sched.schedule()
    for c in plan.chunks:
        c.seq.num_computed_tokens += c.num_tokens
        if c.completes:
            c.seq.output_token_ids.append(0)
    sched.block_manager.pool.check_integrity()
    return [(c.seq.request_id, c.start, c.num_tokens) for c in plan.chunks]


def test_chunked_prefill_follows_the_token_budget() -> None:
    sched = _scheduler(num_blocks=32, budget=8)
    sched.add(SequenceState("a", list(range(10)), SamplingParams()))
    sched.add(SequenceState("b", list(range(3)), SamplingParams()))
    assert _advance(sched) == [("a", 0, 8)]
    assert _advance(sched) == [("a", 8, 2), ("b", 0, 3)]
    assert _advance(sched) == [("a", 10, 1), ("b", 3, 1)]
    assert [len(s.block_table) for s in sched.running] == [3, 1]


def test_admission_waits_for_free_blocks() -> None:
    sched = _scheduler(num_blocks=3, budget=64)
    sched.add(SequenceState("a", list(range(9)), SamplingParams()))  # 3 blocks
    sched.add(SequenceState("b", list(range(2)), SamplingParams()))
    assert _advance(sched) == [("a", 0, 9)]
    assert [s.request_id for s in sched.waiting] == ["b"]
    sched.finish(sched.running[0])
    assert _advance(sched) == [("b", 0, 2)]


def test_preemption_takes_the_newest_and_requeues_it_first() -> None:
    sched = _scheduler(num_blocks=3, budget=64)
    for rid in "abc":
        sched.add(SequenceState(rid, list(range(4)), SamplingParams()))  # one full block each
    assert _advance(sched) == [("a", 0, 4), ("b", 0, 4), ("c", 0, 4)]
    # The pool is full and each decode needs a 2nd block: a preempts c and takes its block,
    # then b finds nothing free and, being the newest left, preempts itself.
    plan = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1)]
    assert [s.request_id for s in plan.preempted] == ["c", "b"]
    assert [s.request_id for s in sched.waiting] == ["b", "c"]
    b = sched.waiting[0]
    assert (b.status, b.block_table, b.num_computed_tokens, b.metrics.num_preemptions) == (
        SequenceStatus.WAITING, [], 0, 1)
    assert b.num_tokens == 5  # tokens are kept; the KV is recomputed on readmission


def _workload(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(42)
    prompts = [[256] + [rng.randrange(256) for _ in range(rng.randrange(2, 40))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 14), ignore_eos=True) for _ in range(n)]
    return prompts, params


def test_fifty_concurrent_requests_equal_solo_runs_under_preemption() -> None:
    config = EngineConfig(block_size=4, num_gpu_blocks=28, max_num_batched_tokens=48, max_num_seqs=24,
                          dtype="float32", backend="torch")
    prompts, params = _workload(50)
    batched = LLM(config=config)
    seqs = [batched.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps = 0
    while batched.has_unfinished():
        batched.step()
        batched.pool.check_integrity()
        steps += 1
    assert batched.pool.num_free == config.num_gpu_blocks
    assert sum(s.metrics.num_preemptions for s in seqs) > 0, "the tiny pool must force preemption"
    solo = LLM(config=config)
    for seq, prompt, sp in zip(seqs, prompts, params):
        (alone,) = solo.generate([prompt], sp)
        assert seq.output_token_ids == alone.token_ids, f"request {seq.request_id} diverged"
        assert len(alone.token_ids) == sp.max_tokens
    assert steps < sum(len(p) + sp.max_tokens for p, sp in zip(prompts, params))  # really batched
