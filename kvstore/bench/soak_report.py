"""What a soak run observed, the memory-growth fit, the figures it reports and its plot."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.bench.harness import Results, SuiteOptions
from kvstore.bench.soak_blocks import OpCounts
from kvstore.bench.soak_procs import RssSample

MB = 1e6
WARMUP_FRACTION = 0.25
"""Share of each daemon lifetime left out of the growth fit (imports, arena and caches filling)."""
WARMUP_MIN_S = 3.0
"""Least time left out at the start of each daemon lifetime."""


@dataclass(frozen=True)
class Marker:
    """A kill (or restart) at ``t`` seconds into the run: ``kind`` is ``client`` or ``daemon``."""

    t: float
    kind: str


@dataclass
class HoldCheck:
    """Daemon STATS after every client was killed at once: ``holds`` and reserved host slots."""

    holds_at_kill: int = -1
    """Held by the frozen clients just before the kill (-1: no reading)."""
    reserved_at_kill: int = -1
    freeze_tries: int = 0
    """Freezes it took to catch the clients holding something (or the limit)."""
    holds_now: int = -1
    """Once the daemon has seen every killed client's connection end."""
    reserved_now: int = -1
    seconds_to_now: float = math.nan
    holds_after_deadline: int = -1
    """After the hold timeout (plus one reaper period) has passed since the kill."""
    reserved_after_deadline: int = -1
    seconds_to_deadline: float = math.nan


@dataclass
class SoakRecord:
    """Everything a soak run observed (filled by the driver, turned into figures by :func:`report`)."""

    duration_s: float = 0.0
    rss: list[RssSample] = field(default_factory=list)
    """Samples of the main phase and the hold check (the growth fit uses the main phase's)."""
    markers: list[Marker] = field(default_factory=list)
    client_kills: int = 0
    daemon_kills: int = 0
    client_restarts: int = 0
    daemon_restarts: int = 0
    client_crashes: int = 0
    """Clients that exited without being killed."""
    daemon_crashes: int = 0
    """Daemon exits the driver did not cause."""
    counts: OpCounts = field(default_factory=OpCounts)
    acked: int = 0
    """Acknowledged blocks checked after the final restart."""
    lost: int = 0
    wrong_final: int = 0
    """Wrong bytes in the final check (the clients' own checks are in ``counts.wrong``)."""
    foreign_final: int = 0
    """Blocks of another identity served in the final check (tenants; the clients' own in ``counts.foreign_hits``)."""
    foreign_checked: int = 0
    """Blocks of other identities asked for in the final check."""
    disk_evictions: int = 0
    write_failures: int = 0
    puts_stopped_at_s: float | None = None
    """When the disk got near its cap and the clients switched to reading only (``None``: never)."""
    holds: HoldCheck = field(default_factory=HoldCheck)
    exit_code: int | None = None
    """Exit status of the final SIGTERM'd daemon (``None``: it hung and was killed)."""


def growth_mb_per_min(samples: list[RssSample], attr: str) -> float:
    """Common slope (MB/min) of ``attr`` over time within each daemon lifetime, after its warm-up.

    One line per lifetime with its own intercept and one shared slope (a pooled
    within-group least-squares fit), so a restart's drop does not read as
    shrinkage. NaN when the steady parts hold too few samples.
    """
    by_pid: dict[int, list[RssSample]] = {}
    for s in samples:
        by_pid.setdefault(s.pid, []).append(s)
    sxy = sxx = 0.0
    for group in by_pid.values():
        t_start, t_end = group[0].t, group[-1].t
        cut = t_start + max(WARMUP_MIN_S, WARMUP_FRACTION * (t_end - t_start))
        steady = [s for s in group if s.t >= cut]
        if len(steady) < 3:
            continue
        tm = sum(s.t for s in steady) / len(steady)
        vm = sum(getattr(s, attr) for s in steady) / len(steady)
        sxy += sum((s.t - tm) * (getattr(s, attr) - vm) for s in steady)
        sxx += sum((s.t - tm) ** 2 for s in steady)
    return sxy / sxx * 60 / MB if sxx > 0 else math.nan


def report(results: Results, r: SoakRecord) -> None:
    """Add the run's figures and notes to ``results``."""
    must0: dict[str, Any] = {"must_be": 0}
    results.add("acked.lost", r.lost, "blocks", **must0, checked=r.acked)
    results.add("served.wrong", r.counts.wrong + r.wrong_final, "blocks", **must0)
    results.add("acked.checked", r.acked, "blocks")
    results.add("served.foreign", r.counts.foreign_hits + r.foreign_final, "blocks", **must0,
                asked=r.counts.foreign_gets + r.foreign_checked)
    main = [s for s in r.rss if s.t <= r.duration_s]
    results.add("daemon.rss_growth", growth_mb_per_min(main, "vm_rss"), "MB/min", measure="VmRSS")
    results.add("daemon.rss_anon_growth", growth_mb_per_min(main, "rss_anon"), "MB/min", measure="RssAnon")
    results.add("daemon.rss_file_growth", growth_mb_per_min(main, "rss_file"), "MB/min", measure="RssFile")
    results.add("daemon.rss_peak", max((s.vm_rss for s in r.rss), default=0) / MB, "MB", measure="VmRSS")
    results.add("daemon.rss_anon_peak", max((s.rss_anon for s in r.rss), default=0) / MB, "MB", measure="RssAnon")
    lc = r.holds
    for when, holds, reserved, seconds in (
            ("at_kill", lc.holds_at_kill, lc.reserved_at_kill, 0.0),
            ("immediately", lc.holds_now, lc.reserved_now, lc.seconds_to_now),
            ("after_deadline", lc.holds_after_deadline, lc.reserved_after_deadline, lc.seconds_to_deadline)):
        results.add("holds.client_death", holds, "holds", when=when, seconds=round(seconds, 2))
        results.add("host.reserved.client_death", reserved, "slots", when=when, seconds=round(seconds, 2))
    results.note(f"Holds: every client was frozen (SIGSTOP) at random moments until STATS showed it with a "
                 f"read hold or reservation ({lc.freeze_tries} tries), then killed -9 at once. 'immediately' is read "
                 f"once the daemon saw the connections end; 'after_deadline' once the hold timeout passed. "
                 f"-1 means the daemon did not answer STATS.")
    c = r.counts
    for name, value in (("puts", c.puts), ("puts_ok", c.puts_ok), ("gets", c.gets), ("hits", c.hits),
                        ("flushes", c.flushes), ("flush_failures", c.flush_failures), ("acked", c.acked)):
        results.add(f"client.{name}", value, "blocks" if name not in ("flushes", "flush_failures") else "requests")
    results.add("client.block_ops_per_s", (c.puts + c.gets) / r.duration_s if r.duration_s else math.nan, "blocks/s")
    results.add("kills.client", r.client_kills, "kills")
    results.add("kills.daemon", r.daemon_kills, "kills")
    results.add("restarts.client", r.client_restarts, "restarts")
    results.add("restarts.daemon", r.daemon_restarts, "restarts")
    results.add("crashes.client", r.client_crashes, "exits", **must0)
    results.add("crashes.daemon", r.daemon_crashes, "exits", **must0)
    results.add("disk.evictions", r.disk_evictions, "blocks", **must0)
    results.add("daemon.write_failures", r.write_failures, "blocks", **must0)
    results.add("daemon.exit_code", -1 if r.exit_code is None else r.exit_code, "status", signal="SIGTERM", must_be=0)
    results.add("duration", r.duration_s, "s")
    results.note("Acknowledged = put returned true and a later FLUSH on the same connection succeeded; every such "
                 "block is read back after a final kill -9 and restart of the daemon. The disk cap is sized so "
                 "nothing acknowledged is evicted: clients stop putting when the disk tier is 70% full "
                 "(disk.evictions must stay 0, else lost blocks are not attributable).")
    results.note("RSS growth is a common slope over each daemon lifetime after its warm-up (first 25%, >= 3 s). "
                 "VmRSS = RssAnon (private heap: where a leak shows) + RssFile (LMDB's map of data.mdb, paged in as "
                 "blocks are read; bounded by the disk cap) + RssShmem (the host arena, fixed).")
    if r.puts_stopped_at_s is not None:
        results.note(f"the disk tier reached 70% of its cap at {r.puts_stopped_at_s:.0f} s; clients only read after")


class SoakResults(Results):
    """A soak run's :class:`Results` plus its :class:`SoakRecord` (the time series the plot draws)."""

    def __init__(self, options: SuiteOptions, config: dict[str, Any], record: SoakRecord) -> None:
        super().__init__("soak", options, config)
        self.record = record


def plot(results: SoakResults, path: Path) -> None:
    """Daemon RSS and RssAnon over time, one line per daemon lifetime, with client and daemon kills marked."""
    from kvstore.bench.plots import grid, save

    record = results.record

    fig, (ax,) = grid(1, "soak: daemon memory under kill -9 of clients and daemon", size=(9.0, 4.2))
    by_pid: dict[int, list[RssSample]] = {}
    for s in record.rss:
        by_pid.setdefault(s.pid, []).append(s)
    for i, group in enumerate(by_pid.values()):
        ax.plot([s.t for s in group], [s.vm_rss / MB for s in group], color="tab:blue",
                label="VmRSS" if i == 0 else None)
        ax.plot([s.t for s in group], [s.rss_anon / MB for s in group], color="tab:green",
                label="RssAnon" if i == 0 else None)
        ax.plot([s.t for s in group], [s.rss_file / MB for s in group], color="tab:orange", linewidth=0.8,
                label="RssFile" if i == 0 else None)
    ax.axvspan(record.duration_s, max([record.duration_s] + [m.t for m in record.markers]), color="0.9",
               label="hold check, final restart")
    shown: set[str] = set()
    for m in record.markers:
        style = {"client": ("tab:gray", ":"), "daemon": ("tab:red", "--")}[m.kind]
        ax.axvline(m.t, color=style[0], linestyle=style[1], linewidth=1,
                   label=None if m.kind in shown else f"kill -9 {m.kind}")
        shown.add(m.kind)
    ax.set_xlabel("seconds")
    ax.set_ylabel("MB")
    ax.set_title(f"lost {results.value('acked.lost'):.0f}, wrong {results.value('served.wrong'):.0f}, "
                 f"RssAnon {results.value('daemon.rss_anon_growth'):.2f} MB/min", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    save(fig, path)
