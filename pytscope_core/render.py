"""Console rendering: pure functions from a `Summary` (or findings) to rich renderables.

Nothing here measures or decides; it lays out what the summary says. The output stays small for any run
length (the loss chart is at most 40 block means, the rank table at most 12 rows plus an omission line),
percentages of a breakdown are rounded so that the printed ones add up to exactly 100, and NaN/inf print
as "n/a" instead of breaking the layout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from .analysis.convergence import TREND_MIN_STEPS
from .analysis.efficiency import SegmentSpan
from .analysis.timing import few_steps_note
from .context import DIED
from .findings import Finding, Severity, format_ranks
from .summary import Summary

BAR_WIDTH = 30
SPARK_CHARS = "▁▂▃▄▅▆▇█"
MAX_RANK_ROWS = 16
"""Above this many ranks the table shows the slowest 8 and the fastest 4 by local work."""
MAX_NOTES = 8
"""Scope notes and errors the console shows, the first ones (all of them in --json): a report stays small."""
MAX_RANK_END_ROWS = 8
"""Ranks whose own records (and why they end) the run summary lists, those that end earliest first."""
MAX_LAUNCHES_SHOWN = 6
"""Launches on different numbers of ranks listed on the world-size line, the first and the last ones."""
_SEVERITY_STYLE = {Severity.HIGH: "bold red", Severity.MED: "yellow", Severity.LOW: "dim"}


def _num(x: float | None, fmt: str = ".2f", unit: str = "") -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:{fmt}}{unit}"


def percentages(shares: Sequence[float], decimals: int = 1) -> list[float]:
    """Round shares to percentages with `decimals` places that add up to exactly 100 (largest remainder)."""
    scale = 10**decimals
    clean = [s if math.isfinite(s) and s > 0 else 0.0 for s in shares]
    total = sum(clean)
    if total <= 0:
        return [0.0 for _ in shares]
    raw = [s / total * 100 * scale for s in clean]
    floors = [math.floor(r) for r in raw]
    missing = 100 * scale - sum(floors)
    order = sorted(range(len(raw)), key=lambda i: raw[i] - floors[i], reverse=True)
    for i in order[:missing]:
        floors[i] += 1
    return [f / scale for f in floors]


def sparkline(values: Sequence[float]) -> str:
    """One character per value (callers pass at most ~40 block means); non-finite values print as a space."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return ""
    lo, hi = min(finite), max(finite)
    span = hi - lo
    out = []
    for v in values:
        if not math.isfinite(v):
            out.append(" ")
        else:
            level = 0 if span <= 0 else int((v - lo) / span * (len(SPARK_CHARS) - 1))
            out.append(SPARK_CHARS[level])
    return "".join(out)


def _section(title: str) -> Text:
    return Text(f"\n{title}", style="bold underline")


def render_run(summary: Summary) -> RenderableType:
    r = summary.run
    g = summary.efficiency.goodput
    table = Table.grid(padding=(0, 2))
    table.add_row("world size", _world_sizes(r.world_size, g.segments))
    gaps = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in r.unrecorded)
    table.add_row(
        "steps",
        f"{r.steps}"
        + (f" ({r.first_step}-{r.last_step})" if r.first_step is not None else "")
        + (f"; none recorded for {gaps}: run by a launch that ended before it wrote them" if gaps else ""),
    )
    table.add_row("restarts", str(r.restarts))
    if r.parallelism:
        table.add_row("parallelism", Text(r.parallelism + (f": {r.comm_note}" if r.comm_note else "")))
    for note in _first(summary.scope_notes, "notes"):  # what the scope could not measure, why it ended early
        table.add_row("note", Text(note))
    # The ranks whose records end earliest first; a large job's others in one line (all in --json).
    ends = sorted(r.rank_ends, key=lambda e: (e.last_step is not None, e.last_step or 0, e.rank))
    for end in ends[:MAX_RANK_END_ROWS]:
        where = (
            "no records"
            if end.last_step is None
            else f"records run to the last step ({end.last_step}), written by the rank itself"
            if end.last_step == r.last_step
            else f"records end at step {end.last_step}"
        )
        table.add_row(f"rank {end.rank}", Text(f"{where}: {end.reason}"))  # the reason may quote an error
    if len(ends) > MAX_RANK_END_ROWS:
        more = len(ends) - MAX_RANK_END_ROWS
        table.add_row("", Text(f"... and {more} more ranks' own records, with why (run.rank_ends in --json)"))
    if not r.ended:
        table.add_row("end", Text(_no_summary(summary)))
    if r.steps == 0:  # (a run whose first gather has not come: no time is known yet)
        table.add_row("elapsed", "n/a")
        table.add_row("goodput", "n/a")
        if r.device:
            table.add_row("device", Text(r.device))
        return Group(_section("Run summary"), table)
    table.add_row("elapsed", _num(g.elapsed_s, ".1f", " s"))
    goodput = "n/a" if not math.isfinite(g.goodput) else f"{100 * g.goodput:.1f}%"
    lost = [
        f"downtime {_num(g.downtime_s, '.1f', ' s')}",
        f"replayed {_num(g.replayed_s, '.1f', ' s')}",
        f"warm-up {_num(g.warmup_s, '.1f', ' s')}",
    ]
    if g.excluded_s >= 0.05:  # what the elapsed time also holds, where it is there to see
        lost.append(f"paused (validation, checkpoints) {_num(g.excluded_s, '.1f', ' s')}")
    if g.hang_s >= 0.05:  # stuck after the last step until DIST.HANG's report: not start-up or teardown
        lost.append(f"hung (DIST.HANG) {_num(g.hang_s, '.1f', ' s')}")
    if g.unaccounted_s >= 0.05:
        lost.append(f"outside steps (start-up, gathers, teardown) {_num(g.unaccounted_s, '.1f', ' s')}")
    table.add_row("goodput", f"{goodput} ({', '.join(lost)})")
    if r.device:
        table.add_row("device", Text(r.device))
    return Group(_section("Run summary"), table)


def _no_summary(summary: Summary) -> str:
    """Why the run has no end-of-run summary, as far as it says: a hang, a SIGTERM that reached every rank
    (each wrote its records and why), else a kill or a run still going."""
    r = summary.run
    if any(f.code == "DIST.HANG" and f.severity is Severity.HIGH for f in summary.findings):
        return (
            "no end-of-run summary: ended by the hang below (on_hang='abort'), killed, or still hung "
            "(on_hang='report')"
        )
    said = {e.rank: e.reason for e in r.rank_ends}
    if len(said) >= r.world_size and all(why.startswith("SIGTERM") for why in said.values()):
        return "no end-of-run summary: SIGTERM stopped every rank (each wrote its own records first)"
    died = next((e for e in r.rank_ends if DIED in e.reason), None)
    if died is not None:  # (the launcher then ends the others)
        signal = died.reason.split(DIED, 1)[1].split(" ", 1)[0]
        return (
            f"no end-of-run summary: rank {died.rank} died of {signal} (a fatal signal), and the job with it"
        )
    return "no end-of-run summary: killed (SIGKILL, out of memory, a hang's abort) or still running"


def _world_sizes(world_size: int, segments: Sequence[SegmentSpan]) -> str:
    """ "4", or for a job resumed on other numbers of ranks each launch's: "4 (steps 1-50), then 2 (41-90)"."""
    ran = [s for s in segments if s.steps > 0]
    if len({s.world_size for s in ran}) < 2:
        return str(world_size)
    launches = [f"{s.world_size} (steps {s.first_step}-{s.last_step})" for s in ran]
    if len(launches) > MAX_LAUNCHES_SHOWN:  # an elastic job restarted hundreds of times: the ends of the list
        half = MAX_LAUNCHES_SHOWN // 2
        hidden = len(launches) - 2 * half
        launches = [*launches[:half], f"... {hidden} more launches ...", *launches[-half:]]
    return ", then ".join(launches)


def render_timing(summary: Summary) -> RenderableType:
    t = summary.timing
    note = few_steps_note(t.steps_counted)
    head = Text(
        f"step time: {_no_steps(summary)}"
        if summary.run.steps == 0
        else f"step time: median {_num(t.median_ms)} ms, p95 {_num(t.p95_ms)} ms over {t.steps_counted} steps"
        + (f" ({note})" if note else "")
    )
    table = Table(box=None, show_header=True, pad_edge=False)
    table.add_column("phase")
    table.add_column("share", justify="right")
    table.add_column("median ms", justify="right")
    table.add_column("")
    pcts = percentages([p.share for p in t.phases])
    timed = _any_time([p.share for p in t.phases])
    for p, pct in zip(t.phases, pcts, strict=False):
        if p.name == "comm" and not summary.run.comm_measured:
            table.add_row(p.name, "not measured", "", "")
            continue
        if not timed:  # shares of no time at all: not known (0.0% each would not add up to 100)
            table.add_row(p.name, "n/a", _num(p.median_ms), "")
            continue
        bar = "█" * round(pct / 100 * BAR_WIDTH)
        table.add_row(p.name, f"{pct:.1f}%", _num(p.median_ms), bar)
    return Group(_section("Step-time breakdown"), head, table)


def render_convergence(summary: Summary) -> RenderableType:
    c = summary.convergence
    lines = [
        f"trend: {c.trend.trend}"
        + (
            f" from step {c.nonfinite_tail.step} on (before it: {100 * c.trend.relative_change:+.1f}%, t = "
            f"{c.trend.t:.1f})"
            if c.trend.trend == "non-finite" and c.nonfinite_tail is not None and math.isfinite(c.trend.t)
            else f" ({100 * c.trend.relative_change:+.1f}%, t = {c.trend.t:.1f}"
            + ("; a fall within the noise: more steps will tell)" if c.trend.trend == "unclear" else ")")
            if math.isfinite(c.trend.t)
            else f" ({_no_steps(summary, why=True)})"
            if summary.run.steps == 0
            else " (no loss was logged: pass it to scope.log(loss=...); under Lightning, return it from training_step)"
            if c.trend.trend == "unknown" and not math.isfinite(c.first_loss) and c.nonfinite_step is None
            else f" ({c.trend.finite_steps} finite losses past warm-up; a trend needs {TREND_MIN_STEPS})"
            if c.trend.trend == "unknown"
            else ""
        ),
        f"loss: first {_num(c.first_loss, '.4g')}, last {'finite ' if c.nonfinite_step is not None else ''}"
        f"{_num(c.last_loss, '.4g')}",
    ]
    if c.rise is not None:
        lines[0] += (
            f"; rising since about step {c.rise.step} (from near {c.rise.lowest:.4g} to {c.rise.last:.4g})"
        )
    elif c.plateau is not None:
        lines[0] += f"; flat from about step {c.plateau.step} ({100 * c.plateau.relative_change:+.1f}% since)"
    spark = sparkline(c.sparkline_values)
    if spark:
        lines.append(f"loss  {spark}" + ("  (finite values only)" if c.nonfinite_step is not None else ""))
    if c.spikes:
        steps = ", ".join(str(s.step) for s in c.spikes[:10]) + (" ..." if len(c.spikes) > 10 else "")
        lines.append(f"spikes: {len(c.spikes)} at step(s) {steps}")
    else:
        lines.append("spikes: none")
    if c.nonfinite_step is not None:
        tail = c.nonfinite_tail
        lines.append(
            f"non-finite loss first at step {c.nonfinite_step}"
            + (
                f"; non-finite to the end from step {tail.step}"
                + (
                    f" on rank(s) {format_ranks(tail.ranks)}"
                    if tail.ranks and len(tail.ranks) < summary.run.world_size
                    else ""
                )
                if tail is not None
                else f"; non-finite in the last {c.nonfinite_last_steps} step(s) ({c.nonfinite_steps} in all)"
                if c.nonfinite_last_steps
                else f"; finite again after it ({c.nonfinite_steps} non-finite step(s) in all)"
            )
        )
    if c.skipped is not None:
        x = c.skipped
        lines.append(
            f"optimizer skipped {x.steps} of {x.counted} steps past warm-up (first at step {x.first_step})"
            + (f"; none trained from step {x.tail_step} to the end" if x.tail_step is not None else "")
        )
    return Group(_section("Convergence"), *(Text(line) for line in lines))


def render_distributed(summary: Summary) -> RenderableType:
    d = summary.distributed
    if summary.run.world_size < 2:
        return Group(_section("Distributed"), Text("one rank: nothing to compare"))
    if summary.run.steps == 0:
        return Group(_section("Distributed"), Text(_no_steps(summary)))
    if len(d.per_rank) < 2:
        return Group(_section("Distributed"), Text("one rank's step records: nothing to compare"))
    if not d.comm_measured:
        return Group(_section("Distributed"), Text(d.note or "communication not measured"))
    counted = d.effective  # the marked ranks are the stragglers that count, late ones included
    head = Text(
        f"transfer {_num(d.transfer_ms)} ms in the median step, {100 * d.transfer_share:.1f}% of all wall time; sync wait "
        f"{100 * d.sync_wait_share:.1f}%, persistent stragglers cost {100 * d.lost_to_imbalance:.1f}% "
        "(transfer/wait split is an estimate)"
    )
    rows = list(d.per_rank)
    omitted = 0
    if len(rows) > MAX_RANK_ROWS:
        by_local = sorted(
            rows, key=lambda r: r.local_ms if math.isfinite(r.local_ms) else -math.inf, reverse=True
        )
        rows = by_local[:8] + by_local[-4:]
        omitted = len(d.per_rank) - len(rows)
    # Grouped by node: a host column, rows sorted by host then rank (where the run recorded hosts).
    place = {r.rank: (h, lr) for r, h, lr in zip(d.per_rank, d.hosts, d.local_ranks, strict=False)}
    rows.sort(key=lambda r: (place[r.rank][0], r.rank) if place else ("", r.rank))
    table = Table(box=None, pad_edge=False)
    names = ("host", "rank", "local rank") if place else ("rank",)
    for name in (*names, "local ms*", "comm ms*", "sync wait ms*", "critical path", ""):
        table.add_column(name, justify="left" if name in ("", "rank", "host") else "right")
    for r in rows:
        where = (place[r.rank][0], str(r.rank), str(place[r.rank][1])) if place else (str(r.rank),)
        table.add_row(
            *where,
            _num(r.local_ms),
            _num(r.comm_ms),
            _num(r.sync_wait_ms),
            f"{100 * r.critical_share:.0f}%",
            ("◀ straggler" if counted.until is None else "◀ straggled")
            if r.rank in counted.stragglers
            else "",
        )
    parts: list[RenderableType] = [
        _section("Distributed"),
        head,
        table,
        Text(
            "* median over the counted steps"
            if d.steps_counted >= summary.timing.steps_counted
            else f"* median over the {d.steps_counted} counted steps all {len(d.per_rank)} ranks ran "
            f"(of {summary.timing.steps_counted}); the shares above are of those steps' wall time"
        ),
    ]
    if omitted:
        parts.append(Text(f"... {omitted} ranks omitted (showing the slowest 8 and fastest 4 by local work)"))
    late, ended = d.late, d.ended
    if late is not None and late.since is not None:
        slow = [late.rank(r) for r in late.stragglers]
        parts.append(
            Text(
                f"since around step {late.since}: rank{'s' if len(slow) > 1 else ''} "
                f"{', '.join(str(r.rank) for r in slow)} {'are stragglers' if len(slow) > 1 else 'is a straggler'} ("
                + ", ".join(f"{r.local_ms:.2f} ms of local work" for r in slow)
                + f" vs {late.next_slowest_local_ms:.2f} ms), costing {100 * late.lost_to_imbalance:.1f}% of "
                "those steps' wall time"
            )
        )
    if ended is not None:
        slow = [ended.rank(r) for r in ended.stragglers]
        parts.append(
            Text(
                (f"from around step {ended.since} " if ended.since is not None else "")
                + f"until around step {ended.until}: rank{'s' if len(slow) > 1 else ''} "
                f"{', '.join(str(r.rank) for r in slow)} "
                f"{'were stragglers' if len(slow) > 1 else 'was a straggler'} ("
                + ", ".join(f"{r.local_ms:.2f} ms of local work" for r in slow)
                + f" vs {ended.next_slowest_local_ms:.2f} ms), costing "
                f"{100 * ended.lost_to_imbalance:.1f}% of those steps' wall time, "
                f"{100 * ended.lost_share_of_window:.1f}% of all; no longer since"
            )
        )
    span = late or ended
    if d.intermittent is not None and not (span is not None and d.intermittent.rank in span.stragglers):
        w = d.intermittent
        parts.append(
            Text(
                f"rank {w.rank} is slow now and then: {w.steps} of the {w.slow_steps} steps of 1.5x the median, "
                f"+{w.extra_ms:.2f} ms of its own work (most in {w.phase})"
                + (f", every {w.every} steps" if w.every else "")
            )
        )
    return Group(*parts)


def render_efficiency(summary: Summary) -> RenderableType:
    e = summary.efficiency
    table = Table(box=None, pad_edge=False)
    table.add_column("line")
    table.add_column("share", justify="right")
    table.add_column("ms/step", justify="right")
    table.add_column("recoverable")
    timed = _any_time([x.share for x in e.budget if x.measured])
    for line, pct in zip(e.budget, percentages([x.share for x in e.budget]), strict=False):
        if not line.measured:
            table.add_row(line.name, "not measured", "", "")
            continue
        if not timed:
            table.add_row(line.name, "n/a", "n/a", "yes" if line.recoverable else "")
            continue
        table.add_row(line.name, f"{pct:.1f}%", _num(line.ms_per_step), "yes" if line.recoverable else "")
    mfu = "n/a" if e.mfu is None else f"{100 * e.mfu:.1f}%"
    recoverable = f"{100 * e.recoverable_share:.1f}%" if timed else "n/a"
    return Group(
        _section("Efficiency budget"),
        table,
        Text(f"recoverable {recoverable} of wall; MFU {mfu}"),
    )


def _any_time(shares: Sequence[float]) -> bool:
    """Whether a breakdown has any time to share out: without it (no step recorded yet) its shares are not
    0% each, they are not known."""
    return any(math.isfinite(x) and x > 0 for x in shares)


def _no_steps(summary: Summary, why: bool = False) -> str:
    """What a report of no step records says of the steps' times and losses: a running job's first gather
    has not come (`why`: each gather writes every rank's steps, their losses with them), not that nothing was
    timed or logged."""
    if summary.run.ended:
        return "no step was recorded"
    return "no step records yet" + (
        ": each gather, every `interval` steps, writes them with their losses" if why else ""
    )


def render_findings(findings: Sequence[Finding]) -> RenderableType:
    """Findings, most severe first: severity, title and code, then the numbers and what to do."""
    if not findings:
        return Text("No findings.")
    parts: list[RenderableType] = []
    for f in findings:
        head = Text()
        head.append(f"[{f.severity.name}] ", style=_SEVERITY_STYLE.get(f.severity, ""))
        head.append(f.title, style="bold")
        head.append(f"  ({f.code})", style="dim")
        parts.append(head)
        parts.append(Text(f"  {f.detail}"))
        parts.append(Text(f"  → {f.recommendation}", style="italic"))
    return Group(*parts)


def _first(texts: tuple[str, ...], what: str) -> list[str]:
    """The first MAX_NOTES of `texts`, and a line saying how many more there are."""
    more = len(texts) - MAX_NOTES
    return list(texts[:MAX_NOTES]) + (
        [f"... and {more} more {what} (all of them: --json)"] if more > 0 else []
    )


def render_summary(summary: Summary) -> Group:
    parts: list[RenderableType] = [
        render_run(summary),
        render_timing(summary),
        render_convergence(summary),
        render_distributed(summary),
        render_efficiency(summary),
        _section("Findings"),
        render_findings(summary.findings),
    ]
    if summary.scope_errors:
        parts.append(_section("Scope errors"))
        parts.extend(Text(e) for e in _first(summary.scope_errors, "errors"))
    return Group(*parts)
