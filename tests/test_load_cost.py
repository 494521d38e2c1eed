"""Load or recompute: the decision from measured rates, its margin, the re-measuring load, ``always_load``."""

from __future__ import annotations

from kvstore.config.deadlines import DeadlinesConfig
from kvstore.store.load_clock import MISSED_FACTOR, LoadClock
from kvstore.store.load_cost import MARGIN, REMEASURE_EVERY, LoadCost

BPB = 1 << 20  # a 1 MiB block of 32 tokens


def cost(bandwidth: float, latency: float = 0.0, prefill: float | None = None, always: bool = False) -> LoadCost:
    clock = LoadClock(DeadlinesConfig())
    clock.adopt(bandwidth, latency)
    c = LoadCost(clock, always_load=always)
    if prefill is not None:
        c.record_prefill(int(prefill), 1.0)
    return c


def test_everything_loads_until_the_prefill_rate_is_measured() -> None:
    c = cost(bandwidth=1e3)  # absurdly slow tier, but nothing known of the engine yet
    assert c.decide(10, 32, BPB).load and c.decisions == {"load": 1, "recompute": 0}


def test_a_cpu_engine_loads_and_a_fast_engine_recomputes_a_prefix_behind_a_slow_tier() -> None:
    # 10 blocks = 320 tokens, 10 MiB; a tier at 100 MB/s with 5 ms latency needs ~0.11 s
    cpu = cost(bandwidth=100e6, latency=0.005, prefill=1_000)  # computes them in 0.32 s: load
    gpu = cost(bandwidth=100e6, latency=0.005, prefill=50_000)  # in 6.4 ms: recompute
    d_cpu, d_gpu = cpu.decide(10, 32, BPB), gpu.decide(10, 32, BPB)
    assert d_cpu.load and not d_gpu.load
    assert d_gpu.expected_compute_s is not None and d_gpu.expected_load_s > MARGIN * d_gpu.expected_compute_s
    assert gpu.snapshot()["decisions"] == {"load": 0, "recompute": 1}


def test_a_load_only_a_little_slower_than_compute_still_loads() -> None:
    c = cost(bandwidth=BPB * 32 / 1.5, prefill=32 / 1.0)  # load 1.5 s, compute 1.0 s: within the margin
    assert c.decide(1, 32, BPB).load


def test_a_tier_judged_slow_is_loaded_again_once_in_a_while_to_measure_it() -> None:
    c = cost(bandwidth=1e3, prefill=50_000)
    loads = [c.decide(4, 32, BPB).load for _ in range(3 * REMEASURE_EVERY)]
    assert loads.count(True) == 3 and all(loads[i] for i in range(REMEASURE_EVERY - 1, len(loads), REMEASURE_EVERY))


def test_always_load_loads_whatever_the_rates() -> None:
    c = cost(bandwidth=1e3, prefill=50_000, always=True)
    assert all(c.decide(4, 32, BPB).load for _ in range(20))


def test_the_clock_measures_bandwidth_on_large_loads_and_latency_on_small_ones() -> None:
    clock = LoadClock(DeadlinesConfig(load_floor_ms=100, load_slack=4))
    assert clock.deadline_s(1 << 30) == 0.1 + 4 * (1 << 30) / float(DeadlinesConfig().load_bandwidth)
    clock.record(64 << 20, 0.5)  # 128 MiB/s
    clock.record(4096, 0.002)  # a round trip
    assert abs(clock.bandwidth - (64 << 20) / 0.5) < 1 and clock.latency == 0.002 and clock.measured == 1
    assert abs(clock.deadline_s(64 << 20) - (0.1 + 4 * 0.5)) < 1e-9  # the measured rate sets the deadline


def test_a_load_given_up_at_its_deadline_caps_the_bandwidth_at_once() -> None:
    clock = LoadClock(DeadlinesConfig())
    clock.record(64 << 20, 0.1)  # 640 MiB/s measured
    clock.record_missed(32 << 20, 2.0)  # then a load of 32 MiB given up after 2 s: it needs 4 s or more now
    assert clock.bandwidth == (32 << 20) / (MISSED_FACTOR * 2.0)
    clock.record_missed(32 << 20, 0.5)  # a faster bound does not raise it: each further miss halves it
    assert clock.bandwidth == (32 << 20) / (2 * MISSED_FACTOR * 2.0)
    clock.record_missed(32 << 20, 4.0)  # missed at the deadline the estimate predicts: still lower, never equal
    assert clock.bandwidth == (32 << 20) / (4 * MISSED_FACTOR * 2.0)


def test_a_load_given_up_at_its_worth_is_not_tried_again_when_the_prefill_rate_wavers() -> None:
    # A stalled tier, an engine computing 64 tokens a second: the first match is loaded (the tier was believed
    # fast) and given up when it is no longer worth waiting for. The prefill rate then measures up to MARGIN
    # times slower (a busy machine): the decision stays "recompute" until the re-measuring load, instead of
    # flipping back to the tier that just stalled (on a real vLLM it did: loads 640, 640, 0, 0, 640, 0, 0).
    c = cost(bandwidth=1e9, prefill=64)
    first = c.decide(10, 32, BPB)
    assert first.load and first.worth_s is not None
    c.clock.record_missed(10 * BPB, first.worth_s)
    for slower in (1.0, 1.3, 1.9):
        c.prefill_rate = 64 / slower
        assert not c.decide(10, 32, BPB).load, f"loaded again from the stalled tier at prefill {slower}x slower"
