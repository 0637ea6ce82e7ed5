"""The finding rules: small functions registered by finding code, each with its thresholds beside it.

Every rule reads the `RunAnalysis` (never the raw arrays) and returns zero or more findings. Each threshold is
a named constant with the reason for its value, and every rule has an effect-size floor (a share of wall
time, milliseconds, a relative change) on top of any significance test: a test alone fires on every long
run. A rule that raises is not silenced: `run_rules` re-raises in strict mode, and otherwise logs the
traceback and reports a SCOPE.RULE_ERROR finding naming the rule, so a missing diagnosis is visible.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import warnings
from collections.abc import Callable, Iterable

import numpy as np

from ..context import (
    DIED,
    LEFT,
    PEER_GONE,
    RAISED,
    STOPPED,
    RankFailure,
    ReplicaCheck,
    ended_alone,
    lost_a_peer,
)
from ..findings import Finding, Severity, format_ranks, severity_at
from .distributed import CountDivergence, DistributedTiming, RankTiming, majority
from .run import KILLED, RankEnd, RunAnalysis
from .timing import Stall, few_steps_note

log = logging.getLogger(__name__)

Rule = Callable[[RunAnalysis], Iterable[Finding]]
RULES: dict[str, Rule] = {}


def rule(code: str) -> Callable[[Rule], Rule]:
    """Register a rule function under the finding code it emits."""

    def register(fn: Rule) -> Rule:
        if code in RULES:
            raise ValueError(f"rule {code} registered twice")
        RULES[code] = fn
        return fn

    return register


TIMING_CODES = frozenset(
    {
        "DIST.STRAGGLER",
        "DIST.LOAD_IMBALANCE",
        "DIST.SLOW_NODE",
        "DIST.COMM_BOUND",
        "DATA.INPUT_BOUND",
        "TIMING.JITTER",
        "EFFICIENCY.RECOVERABLE",
        "EFFICIENCY.LOW_MFU",
    }
)
"""Findings judged from step-time statistics: LOW at most while there are too few steps (timing.py)."""


def run_rules(analysis: RunAnalysis, *, strict: bool = False) -> list[Finding]:
    """All registered rules' findings, HIGH first; see the module docstring for failing rules."""
    found = _run_each(analysis, strict)
    note = few_steps_note(analysis.timing.steps_counted)
    if note is not None:
        found = [
            dataclasses.replace(f, severity=Severity.LOW, detail=f"{f.detail} ({note}.)")
            if f.code in TIMING_CODES and f.severity > Severity.LOW
            else f
            for f in found
        ]
    return sorted(found, key=lambda f: (-int(f.severity), f.code, f.ranks))


def _run_each(analysis: RunAnalysis, strict: bool) -> list[Finding]:
    found: list[Finding] = []
    for code, fn in RULES.items():
        try:
            found.extend(fn(analysis))
        except Exception as exc:
            if strict:
                raise
            log.debug("pytscope rule %s failed", code, exc_info=True)  # the finding below says what failed
            found.append(
                Finding(
                    code="SCOPE.RULE_ERROR",
                    severity=Severity.MED,
                    title=f"The {code} check failed and was skipped",
                    detail=f"{type(exc).__name__}: {exc}",
                    recommendation="Report this with the run directory; other findings are unaffected.",
                )
            )
    return found


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


# --- distributed -------------------------------------------------------------------------------------------

STRAGGLER_HIGH_COST = 0.10
"""A straggler costing >= 10% of every rank's wall is the first thing to fix."""
STRAGGLER_MED_COST = 0.03
""">= 3% is worth a look; below that (down to the 2% floor) it is LOW."""


def _cost_severity(share: float) -> Severity:
    return severity_at(share, STRAGGLER_MED_COST, STRAGGLER_HIGH_COST)


@rule("DIST.STRAGGLER")
def straggler(a: RunAnalysis) -> list[Finding]:
    """One rank persistently has the most local work. Floors: excess >= 4.5%, slower in >= 70% of steps (60%
    from an excess of 13.5%; binomial z >= 3), and its extra work over the next-slowest rank >= 2% of wall
    (distributed.py). One that began late is named from where it began (`late`), with its numbers over the
    steps since; one that stopped is said as past (`ended`), with its numbers over the steps it ran slow and
    its severity by what it cost the whole window: nothing on its host needs fixing now."""
    d = a.distributed.effective
    if len(d.stragglers) != 1:
        return []
    rank = d.stragglers[0]
    me = d.rank(rank)
    others = float(np.median([r.local_ms for r in d.per_rank if r.rank != rank]))
    others_data = float(np.median([r.data_ms for r in d.per_rank if r.rank != rank]))
    host = a.ctx.placement.host(rank)
    on_host = f" on host {host}" if host is not None else ""
    if d.until is not None:
        return [_past_straggler(a, d, d.until, others, others_data)]
    return [
        Finding(
            code="DIST.STRAGGLER",
            severity=_cost_severity(d.cost_share),
            title=f"Rank {rank}{on_host} is a straggler: the other ranks "
            + (f"have waited for it since around step {d.since}" if d.since is not None else "wait for it"),
            detail=(
                (
                    f"From around step {d.since} on (before it, no rank was): {a.ctx.placement.describe(rank)}"
                    if d.since is not None
                    else a.ctx.placement.describe(rank).capitalize()
                )
                + f" does {me.local_ms:.2f} ms of local work per "
                f"step vs {others:.2f} ms on the other "
                f"ranks (medians; +{_pct(me.excess)} in its median step against the others' median there); it is "
                "slower than the others' median in "
                f"{_pct(me.slower_share)} of {d.steps_counted} steps (z = {me.z:.1f}) and on the critical "
                f"path in {_pct(me.critical_share)}."
                + (
                    f" Most of its extra work is in `{me.extra_phase}` (+{me.extra_phase_ms:.2f} ms per step)."
                    if me.extra_phase and me.extra_phase_ms > 0
                    else ""
                )
                + f" Waiting for it costs {d.lost_ms_per_step:.2f} ms per "
                f"step, {_pct(d.lost_to_imbalance)} of wall"
                + (
                    f" since then ({_pct(d.lost_share_of_window)} of the wall time of all "
                    f"{a.distributed.steps_counted} steps counted)"
                    if d.since is not None and math.isfinite(d.lost_share_of_window)
                    else ""
                )
                + " (upper bound: the next-slowest rank would then set the pace). The other ranks' wait "
                "shows as sync wait, not as communication."
            ),
            recommendation=(
                (
                    f"Start with rank {rank}'s `{me.extra_phase}` phase; then check"
                    if me.extra_phase
                    else "Check"
                )
                + f" rank {rank}'s host{f' ({host})' if host is not None else ''}: other processes or "
                f"throttling on that CPU/GPU, its data "
                f"loader (data wait {me.data_ms:.2f} ms vs {others_data:.2f} ms on the others) and shard size, then compare its "
                f"phases with the others' in `pytscope trace`."
            ),
            ranks=(rank,),
            evidence=_straggler_evidence(d, me, others),
        )
    ]


def _straggler_evidence(d: DistributedTiming, me: RankTiming, others: float) -> dict[str, float]:
    """DIST.STRAGGLER's numbers, current or past: the straggler `me`'s against the others' over `d`'s steps."""
    return {
        "local_ms": me.local_ms,
        "others_local_ms": others,
        "excess": me.excess,
        "slower_share": me.slower_share,
        "z": me.z,
        "critical_share": me.critical_share,
        "lost_ms_per_step": d.lost_ms_per_step,
        "lost_share": d.lost_to_imbalance,
        **({"since_step": float(d.since)} if d.since is not None else {}),
    }


def _past_straggler(
    a: RunAnalysis, d: DistributedTiming, until: int, others: float, others_data: float
) -> Finding:
    """DIST.STRAGGLER for a straggler that stopped at step `until` (`d` is the analysis of the steps it ran
    slow): said as past, its numbers over those steps, its severity by its share of the whole window's wall
    (what it cost the run), and advice about that span, not about its host now."""
    rank = d.stragglers[0]
    me = d.rank(rank)
    host = a.ctx.placement.host(rank)
    span = f"from around step {d.since} " if d.since is not None else ""
    return Finding(
        code="DIST.STRAGGLER",
        severity=_cost_severity(d.cost_share),
        title=f"Rank {rank}{f' on host {host}' if host is not None else ''} was a straggler "
        f"{span}until around step {until}: the other ranks waited for it, and no longer do",
        detail=(
            (f"From around step {d.since}" if d.since is not None else "From the start")
            + f" until around step {until}, {a.ctx.placement.describe(rank)} did {me.local_ms:.2f} ms of "
            f"local work per step vs {others:.2f} ms on the other ranks (medians; +{_pct(me.excess)} in its "
            f"median step against the others' median there); it was slower than the others' median in "
            f"{_pct(me.slower_share)} of those {d.steps_counted} steps (z = {me.z:.1f}) and on the critical "
            f"path in {_pct(me.critical_share)}."
            + (
                f" Most of its extra work was in `{me.extra_phase}` (+{me.extra_phase_ms:.2f} ms per step)."
                if me.extra_phase and me.extra_phase_ms > 0
                else ""
            )
            + f" Waiting for it cost {d.lost_ms_per_step:.2f} ms per step then, "
            f"{_pct(d.lost_to_imbalance)} of those steps' wall time and {_pct(d.lost_share_of_window)} of "
            f"the wall time of all {a.distributed.steps_counted} steps counted "
            "(upper bound: the next-slowest rank would then have set the pace). From around step "
            f"{until} on it is no slower than the others."
        ),
        recommendation=(
            f"It stopped on its own: nothing on rank {rank}'s host is slow now. To keep it from coming back, "
            f"find what ran on {f'host {host}' if host is not None else 'its host'} in those steps: another "
            "job or process, throttling of its CPU/GPU, its data loader (data wait "
            f"{me.data_ms:.2f} ms vs {others_data:.2f} ms on the others then)"
            + (f"; its `{me.extra_phase}` phase held most of the extra work" if me.extra_phase else "")
            + ". `pytscope trace` shows those steps rank by rank."
        ),
        ranks=(rank,),
        evidence={
            **_straggler_evidence(d, me, others),
            "window_lost_share": d.lost_share_of_window,
            "until_step": float(until),
        },
    )


@rule("DIST.LOAD_IMBALANCE")
def load_imbalance(a: RunAnalysis) -> list[Finding]:
    """Several ranks pass the straggler gates: the work is unevenly split, not one bad host. When those ranks
    are whole nodes, DIST.SLOW_NODE says so instead (one problem, one finding)."""
    d = a.distributed
    if len(d.stragglers) < 2 or slow_nodes(a):
        return []
    slow = [d.rank(r) for r in d.stragglers]
    fast = [r.local_ms for r in d.per_rank if r.rank not in d.stragglers]
    others = float(np.median(fast)) if fast else math.nan
    return [
        Finding(
            code="DIST.LOAD_IMBALANCE",
            severity=_cost_severity(d.lost_to_imbalance),
            title=f"Work is unevenly split: {len(slow)} ranks are persistently slower",
            detail=(
                f"Ranks {format_ranks(d.stragglers)}"
                + (f" ({a.ctx.placement.by_host(d.stragglers)})" if a.ctx.placement.known else "")
                + f" do {min(r.local_ms for r in slow):.2f}-"
                f"{max(r.local_ms for r in slow):.2f} ms of local work per step vs {others:.2f} ms on the "
                f"others (median), each slower than its peers' median in >= "
                f"{_pct(min(r.slower_share for r in slow))} of steps. The rest wait "
                f"{d.lost_ms_per_step:.2f} ms per step for them, {_pct(d.lost_to_imbalance)} of wall."
            ),
            recommendation=(
                "Check whether those ranks get larger or longer samples (variable sequence lengths, uneven "
                "shards) or share slower hosts; bucket batches by length or rebalance the sampler."
            ),
            ranks=tuple(d.stragglers),
            evidence={"lost_ms_per_step": d.lost_ms_per_step, "lost_share": d.lost_to_imbalance},
        )
    ]


SLOW_NODE_MIN_RANKS = 2
"""A node blamed as a whole needs at least two ranks on it: a one-rank node is a DIST.STRAGGLER (named with
its host), where device, data and host cannot be told apart."""


def slow_nodes(a: RunAnalysis) -> tuple[str, ...]:
    """The hosts whose ranks are exactly the slow ranks: every rank of each passes the straggler gates and no
    rank elsewhere does (at least one host is fine)."""
    return a.ctx.placement.whole_hosts(a.distributed.stragglers, SLOW_NODE_MIN_RANKS)


@rule("DIST.SLOW_NODE")
def slow_node(a: RunAnalysis) -> list[Finding]:
    """The slow ranks are all the ranks of one node (or of a few whole nodes), and only those: a host problem
    (throttled CPUs or GPUs, another job on it, its storage or network link), not one rank's device or data.
    Each rank passes the DIST.STRAGGLER floors; DIST.LOAD_IMBALANCE steps aside for these ranks."""
    hosts = slow_nodes(a)
    if not hosts:
        return []
    d = a.distributed
    slow = [d.rank(r) for r in d.stragglers]
    fast = [r.local_ms for r in d.per_rank if r.rank not in d.stragglers]
    others = float(np.median(fast)) if fast else math.nan
    phases = [r.extra_phase for r in slow if r.extra_phase]
    phase = max(set(phases), key=phases.count) if phases else None
    names = ", ".join(hosts)
    plural = len(hosts) > 1
    return [
        Finding(
            code="DIST.SLOW_NODE",
            severity=_cost_severity(d.lost_to_imbalance),
            title=(
                f"Host{'s' if plural else ''} {names} {'are' if plural else 'is'} slow: every rank on "
                f"{'them' if plural else 'it'} is persistently slower"
            ),
            detail=(
                f"All {len(slow)} ranks of host{'s' if plural else ''} {names} (ranks "
                f"{format_ranks(d.stragglers)}) do {min(r.local_ms for r in slow):.2f}-"
                f"{max(r.local_ms for r in slow):.2f} ms of local work per step vs {others:.2f} ms on the "
                f"other hosts' ranks (median), each slower than its peers' median in >= "
                f"{_pct(min(r.slower_share for r in slow))} of steps, and no rank elsewhere is."
                + (f" Most of their extra work is in `{phase}`." if phase else "")
                + f" The rest wait {d.lost_ms_per_step:.2f} ms per step for them, {_pct(d.lost_to_imbalance)} "
                "of wall."
            ),
            recommendation=(
                f"Look at host{'s' if plural else ''} {names} rather than at single ranks: other processes or "
                "jobs on it, CPU/GPU clocks and thermal throttling (`nvidia-smi -q -d PERFORMANCE`), its local "
                "storage and network link; if it stays slow, leave it out of the job (your scheduler's exclude "
                "list) and compare."
            ),
            ranks=tuple(d.stragglers),
            evidence={
                "hosts": float(len(hosts)),
                "ranks_on_slow_hosts": float(len(slow)),
                "lost_ms_per_step": d.lost_ms_per_step,
                "lost_share": d.lost_to_imbalance,
            },
        )
    ]


COMM_MIN_SHARE = 0.20
"""Exposed transfer (least-blocked rank) >= 20% of the step: overlap or bucketing has real room to win."""
COMM_HIGH_SHARE = 0.40
""">= 40%: communication dominates the step."""
COMM_MIN_MS = 0.5
"""Absolute floor: sub-millisecond transfers on tiny steps are not worth tuning."""


@rule("DIST.COMM_BOUND")
def comm_bound(a: RunAnalysis) -> list[Finding]:
    """Exposed *transfer* (never sync wait) is a large share of the step, above an absolute floor."""
    d = a.distributed
    # The typical step must be comm-bound too: a few steps where every rank waited (a preempted collective
    # on oversubscribed cores) raise the mean share without making the job communication-bound.
    typical_share = d.transfer_ms / a.timing.median_ms if a.timing.median_ms > 0 else 0.0
    if not (min(d.transfer_share, typical_share) >= COMM_MIN_SHARE and d.transfer_ms >= COMM_MIN_MS):
        return []
    # Nothing to communicate with (FSDP2's brackets on one rank hold its copies); or one rank's records only,
    # whose least-blocked comm is its wait for the ranks without records, not transfer.
    if a.world_size < 2 or len(d.per_rank) < 2:
        return []
    sharded = (a.ctx.parallelism or "").startswith("fsdp2")
    loop = d.loop_transfer_ms if math.isfinite(d.loop_transfer_ms) else 0.0
    lightning = a.ctx.integration == "lightning"
    collectives = "a barrier, an all-reduce of the loss for logging" + (
        ", the SIGTERM flag Lightning broadcasts at the top of every batch, once per micro-batch"
        if lightning
        else ""
    )
    transfer = (
        f"{d.transfer_ms:.2f} ms in the median step, {_pct(d.transfer_share)} of all wall time (an estimate of "
        "transfer, excluding waits for slower ranks)"
    )
    evidence = {"transfer_ms": d.transfer_ms, "transfer_share": d.transfer_share, "loop_comm_ms": loop}
    severity = Severity.HIGH if d.transfer_share >= COMM_HIGH_SHARE else Severity.MED
    if loop >= LOOP_COMM_MAJORITY * d.transfer_ms:  # not the gradients': the loop's own collectives
        return [
            Finding(
                code="DIST.COMM_BOUND",
                severity=severity,
                title="The loop's own collectives are a large, exposed share of the step",
                detail=(
                    f"Even the least-blocked rank waits in communication: {transfer}; {loop:.2f} ms of it in "
                    f"collectives the loop calls itself ({collectives}), not in gradient communication."
                ),
                recommendation=(
                    "Call fewer collectives per step: reduce metrics across ranks every N steps or at the epoch's "
                    "end"
                    + (" (self.log(..., sync_dist=True) only where needed)" if lightning else "")
                    + ", and drop per-step barriers"
                    + (
                        "; Lightning's SIGTERM broadcast comes with every batch, so accumulating gradients over more "
                        "micro-batches adds to it, and fewer, larger batches lower it"
                        if lightning
                        else ""
                    )
                    + "."
                ),
                evidence=evidence,
            )
        ]
    where = (
        "in FSDP's parameter all-gathers and gradient reduce-scatters"
        if sharded
        else "in gradient communication after its backward finished"
    )
    also = (
        f" ({loop:.2f} ms of it in collectives the loop calls itself: {collectives})"
        if loop >= LOOP_COMM_MENTION * d.transfer_ms
        else ""
    )
    return [
        Finding(
            code="DIST.COMM_BOUND",
            severity=severity,
            title=(
                "FSDP's all-gathers and reduce-scatters are a large, exposed share of the step"
                if sharded
                else "Gradient communication is a large, exposed share of the step"
            ),
            detail=f"Even the least-blocked rank waits {where}: {transfer}{also}.",
            recommendation=_FSDP2_COMM_ADVICE if sharded else _DDP_COMM_ADVICE,
            evidence=evidence,
        )
    ]


LOOP_COMM_MAJORITY = 0.5
"""Where the loop's own collectives are at least half of the exposed transfer, they are what the finding is
about: tuning the gradient all-reduce (buckets, accumulation, compression) would not touch them."""
LOOP_COMM_MENTION = 0.1
"""...and from a tenth of it on, the gradient finding says how much of its transfer they are."""


_DDP_COMM_ADVICE = (
    "Overlap more of the all-reduce with backward (smaller bucket_cap_mb, no find_unused_parameters), "
    "accumulate gradients over more micro-batches per sync, or compress gradients (bf16 hook); check the "
    "interconnect bandwidth first."
)
_FSDP2_COMM_ADVICE = (
    "Fewer, larger sharded units (fully_shard per block, not per layer); prefetch more units "
    "(set_modules_to_forward_prefetch / set_modules_to_backward_prefetch); keep parameters gathered after "
    "forward where memory allows (reshard_after_forward=False, at least on the last blocks); bf16 parameters "
    "and reductions (MixedPrecisionPolicy); across nodes, shard within a node and replicate across (HSDP); "
    "accumulate over more micro-batches per reduce-scatter (set_requires_gradient_sync). Check the "
    "interconnect bandwidth first."
)


@rule("DIST.DESYNC")
def desync(a: RunAnalysis) -> list[Finding]:
    """Ranks disagree on step, grad-sync or micro-batch counts. No floor: any disagreement precedes a hang.

    One finding for one problem: the step where the per-step counts diverge, where the records show it (it
    names the step and the rank), else the first gather whose counters differ."""
    div = a.distributed.count_divergence
    if div is not None:
        return [_divergence_finding(div, others=len(a.distributed.per_rank) - len(div.ranks))]
    out: list[Finding] = []
    for check in a.ctx.counts_checks:
        bad: dict[int, list[str]] = {}
        for name in check.COUNTERS:
            values = np.asarray(check.compared(name), dtype=np.float64)  # (NaN: a rank inside a join)
            compared = np.flatnonzero(np.isfinite(values))
            if compared.size < 2 or np.unique(values[compared]).size < 2:
                continue
            most = majority(values)
            if most is None:  # no majority (2 ranks): nobody singled out
                for i in compared.tolist():
                    bad.setdefault(i, []).append(f"{name} {values[i]:.0f}")
                continue
            for i in compared[values[compared] != most].tolist():
                bad.setdefault(i, []).append(f"{name} {values[i]:.0f} vs {most:.0f}")
        if bad:
            parts = "; ".join(f"rank {r}: {', '.join(v)}" for r, v in sorted(bad.items()))
            out.append(
                Finding(
                    code="DIST.DESYNC",
                    severity=Severity.HIGH,
                    title=f"Ranks disagree on how far training got (gather {check.gather})",
                    detail=f"At gather {check.gather} the ranks' counters differ: {parts}.",
                    recommendation=_DESYNC_ADVICE,
                    ranks=tuple(sorted(bad)),
                    evidence={"gather": float(check.gather)},
                )
            )
            break  # the first divergence is what matters; later ones follow from it
    return out


def _divergence_finding(div: CountDivergence, others: int) -> Finding:
    listed = ", ".join(f"rank {r}: {c:g}" for r, c in zip(div.ranks, div.counts, strict=False))
    what, cause = _COUNTERS[div.counter]
    counts = np.asarray(div.counts)
    missing = not np.isfinite(counts).all()
    # What more or fewer means, where every listed count is more, or every one fewer (none missing).
    hint = (
        ""
        if missing
        else cause[0]
        if (counts > div.majority).all()
        else cause[1]
        if (counts < div.majority).all()
        else ""
    )
    against = (
        f"against {div.majority:g} on the other rank{'s' if others != 1 else ''}"
        if math.isfinite(div.majority)
        else "with no majority to single a rank out"
    )
    return Finding(
        code="DIST.DESYNC",
        severity=Severity.HIGH,
        title=f"{what.capitalize()} diverge at step {div.step}",
        detail=(
            f"In step {div.step} the ranks made different numbers of {what}: {listed}, {against}"
            f"{' (NaN = no record)' if missing else ''}. From here their cumulative counts differ"
            f"{f': {hint}' if hint else ''}."
        ),
        recommendation=_DESYNC_ADVICE,
        ranks=div.ranks,
        steps=(div.step,),
        evidence={"step": float(div.step), "majority": div.majority},
    )


_COUNTERS = {  # counter: (its name in a sentence, (its cause when more than the others', when fewer))
    "grad_syncs": (
        "gradient syncs",
        (
            "more syncs in one step mean an optimizer step that did not happen there (the next iteration's "
            "backward fell into the same step), or no_sync() on the other ranks",
            "fewer mean no_sync() (or a shorter accumulation window) on these ranks only",
        ),
    ),
    "optimizer_steps": (
        "optimizer steps",
        (
            "an optimizer step the other ranks did not take (the replicas' parameters may now differ: "
            "DIST.REPLICA_DRIFT, where replicas are compared)",
            "an optimizer step these ranks did not take (the replicas' parameters may now differ: "
            "DIST.REPLICA_DRIFT, where replicas are compared)",
        ),
    ),
}


_DESYNC_ADVICE = (
    "Look for rank-dependent control flow around backward and the optimizer step first: uneven numbers of "
    "batches per rank (drop_last, uneven shards), `no_sync()`/accumulation windows that differ by rank, or a "
    "skipped step (NaN guard, grad scaler) on some ranks only."
)

REPLICA_REL_TOL = 1e-6
"""Replicas hold bit-identical parameters in data parallel; 1e-6 relative leaves room for summation order."""


def replicas_differ(sums: np.ndarray) -> bool:
    """Whether one gather's parameter checksums (one per rank; NaN: none) disagree beyond REPLICA_REL_TOL: the
    live check keeps exactly the checks that DIST.REPLICA_DRIFT would flag."""
    return bool(_drift(np.asarray(sums, dtype=np.float64).reshape(1, -1))[0].any())


def _drift(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(checks, ranks) checksums -> (where a rank's is off its check's median by more than REPLICA_REL_TOL of
    the check's largest, the medians, the largest) (the last two (checks, 1)). An all-NaN row is no drift."""
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        majority = np.nanmedian(sums, axis=1, keepdims=True)
        scale = np.maximum(np.nanmax(np.abs(sums), axis=1, keepdims=True), 1e-30)
        return np.isfinite(sums) & (np.abs(sums - majority) > REPLICA_REL_TOL * scale), majority, scale


@rule("DIST.REPLICA_DRIFT")
def replica_drift(a: RunAnalysis) -> list[Finding]:
    """Parameter checksums differing from the majority beyond REPLICA_REL_TOL."""
    checks = _one_check_per_step(a.ctx.replica_checks)
    if not checks:
        return []
    width = max(len(c.checksums) for c in checks)
    sums = np.full((len(checks), width), np.nan)
    for i, c in enumerate(checks):  # one row per gather, not per step
        sums[i, : len(c.checksums)] = c.checksums
    steps = np.array([c.step for c in checks])
    drift, majority, scale = _drift(sums)
    rows = np.flatnonzero(drift.any(axis=1))
    if rows.size == 0:
        return []
    first = int(rows[0])
    ranks = tuple(int(r) for r in np.flatnonzero(drift.any(axis=0)))
    first_ranks = np.flatnonzero(drift[first])
    rel = float(np.max(np.abs(sums[first, first_ranks] - majority[first, 0])) / scale[first, 0])
    which = (
        f"the parameter checksum of rank(s) {format_ranks(first_ranks.tolist())} differs from the majority"
    )
    who = ""
    if 2 * first_ranks.size >= np.count_nonzero(np.isfinite(sums[first])):  # (2 ranks: no majority)
        which, who = "the ranks' parameter checksums differ", " No majority singles a rank out"
        div = a.distributed.count_divergence
        # The rank whose counts departed first, before the drift, is the likely one.
        if div is not None and div.step <= int(steps[first]):
            named = f"rank{'s' if len(div.ranks) > 1 else ''} {format_ranks(div.ranks)}"
            who += f"; DIST.DESYNC names {named} at step {div.step}, before it"
            ranks = div.ranks
        who += "."
    return [
        Finding(
            code="DIST.REPLICA_DRIFT",
            severity=Severity.HIGH,
            title="Data-parallel replicas no longer hold the same parameters",
            detail=(
                f"From step {int(steps[first])} {which} by {rel:.2e} (relative; tolerance {REPLICA_REL_TOL:g}); "
                f"{_disagree(rows.size, len(checks))}.{who} Training is no longer equivalent to one worker."
            ),
            recommendation=(
                "Check for parameters updated outside DDP's gradient sync first: buffers or weights changed "
                "in-place per rank, different random init without broadcast, an optimizer step skipped on some "
                "ranks, or non-deterministic kernels acting on unsynchronised state."
            ),
            ranks=ranks,
            steps=tuple(int(s) for s in steps[rows][:50]),
            evidence={"first_step": float(steps[first]), "relative_difference": rel},
        )
    ]


def _one_check_per_step(checks: Iterable[ReplicaCheck]) -> list[ReplicaCheck]:
    """The checks, one per step (the last made there), in the order their steps were first checked: the final
    gather at finish() checks again at the step the last interval gather checked (one step's parameters,
    recorded twice), which counted twice read "5 of 5 checks disagree" for 4. Runs recorded so read right."""
    last = {c.step: c for c in checks}  # (a key keeps its first place; its value is the last check's)
    return list(last.values())


def _disagree(n: int, checks: int) -> str:
    """How many checks disagree: a run records only those that do, so "4 of 4" would read as if every check
    disagreed, those before the first that did (that agreed) included."""
    if n < checks:
        return f"{n} of {checks} checks disagree"
    return f"{n} check{'s disagree' if n != 1 else ' disagrees'}"


@rule("DIST.HANG")
def hang(a: RunAnalysis) -> list[Finding]:
    """Re-emits the watchdog's reports (it has already applied hang_timeout). One that every rank went on
    past (on_hang="report", or a wait that no hang was proven for) was a stall that long, not a hang: it is
    TIMING.STALL's (`_stalls_reported_as_hangs`), or, where that rule reports no stall (a long run, whose
    stalls are under STALL_MIN_SHARE of its wall time), MED at most, and it says so."""
    merged = set(_stalls_reported_as_hangs(a).values())
    out = []
    for i, f in enumerate(_hang_reports(a)):
        if i in merged:
            continue
        if _gone_past(a, f, a.ctx.hang_reports[i].get("segment")):
            f = dataclasses.replace(
                f,
                severity=min(f.severity, Severity.MED),
                detail=f"{f.detail} The run went on: every rank completed that step (the run reached step "
                f"{a.last_step}), so this was a stall of about that length, not a hang.",
            )
        out.append(f)
    return out


def _hang_reports(a: RunAnalysis) -> list[Finding]:
    return [Finding.from_dict(report) for report in a.ctx.hang_reports]


def _gone_past(a: RunAnalysis, f: Finding, segment: object = None) -> bool:
    """Whether every rank completed the step a hang report's waiting ranks were in: the run went on, in the
    launch the report came from (`segment`, where known): a resume that replayed that step after the hang
    ended its launch (on_hang="abort", the launcher's restart) went on past a hang, not a stall. A rank whose
    records end with those it wrote itself at a hang (nothing after them: the hang's abort ended it) did not
    get past its last step: that step is in its records once its optimizer stepped, and the hang may have
    come after (a run recorded before the watchdog named such a wait by the next step: `watchdog._waits_in`)."""
    step = f.steps[0] if f.steps else None
    hung = {rank for rank, why in a.ctx.rank_notes if why == "hang"}
    ended = [
        e.last_step - 1 if e.rank in hung else e.last_step for e in a.rank_ends if e.last_step is not None
    ]
    launch_went_on = (
        not isinstance(segment, int)
        or step is None
        or a.launch_last_steps.get(segment, step) >= step  # (a launch without rows here: not known)
    )
    return (
        step is not None
        and a.last_step is not None
        and a.last_step >= step
        and min(ended, default=a.last_step) >= step
        and launch_went_on
    )


def _stalls_reported_as_hangs(a: RunAnalysis) -> dict[int, int]:
    """{stall step: its hang report's index in `ctx.hang_reports`} for the stalls TIMING.STALL reports that
    the watchdog took for a hang at the time, every rank having gone on past it: the report's step is the one
    the waiting ranks were in, the stall the same step or the one before (the late rank's own), on a rank the
    report named."""
    t = a.timing
    stalls = (
        t.stalls if t.stall_share >= STALL_MIN_SHARE else ()
    ) + t.warm_up_stalls  # (those: whatever share)
    if not stalls or not a.ctx.hang_reports:
        return {}
    out: dict[int, int] = {}
    for i, f in enumerate(_hang_reports(a)):
        if not _gone_past(a, f, a.ctx.hang_reports[i].get("segment")):
            continue
        step = f.steps[0]
        for s in stalls:
            if s.step in (step - 1, step) and (not f.ranks or s.rank in f.ranks) and s.step not in out:
                out[s.step] = i
                break
    return out


@rule("RUN.FAILED")
def failed(a: RunAnalysis) -> list[Finding]:
    """The rank whose exception came first, each time one ended a launch, or that left the job first (its
    process ended without finish() while another rank waited for it): the other ranks' errors (a
    collective's "connection closed by peer") most likely followed from it. Where every error of a launch is
    such a lost connection, the rank that ended first without one is named instead: killed (its records just
    stop, nothing said) or ended alone (it finished or exited while the others trained on). HIGH where it
    ended the run, MED where the job was resumed past it (the restart's cost is in the goodput)."""
    out, seen = [], set()
    for failure in a.ctx.failures:
        # One finding per launch (a run from before launches were written: whether the job went on past).
        if _launch_of(failure) not in seen:
            seen.add(_launch_of(failure))
            out.append(launch_failed(a, failure))
    return out


def launch_failed(a: RunAnalysis, failure: RankFailure) -> Finding:
    """RUN.FAILED of the launch `failure` ended: the rank whose failure came first there, or gone first."""
    same = [f for f in a.ctx.failures if _launch_of(f) == _launch_of(failure)]
    # A lost connection follows a rank that was gone: another failure of the launch is the cause, whatever
    # the order the ranks wrote them in (their clocks, their exit paths).
    first = next((f for f in same if not lost_a_peer(f.reason)), same[0])
    gone = _gone_first(a, first, same) if lost_a_peer(first.reason) else None
    return _peer_gone(a, gone, same) if gone is not None else _failure(a, first, same)


def stopped_note(a: RunAnalysis, note: str) -> str:
    """A scope note that its rank stopped without a final gather, on an error that followed another rank's
    (a collective's lost connection to a rank that had failed or gone), headed by the cause RUN.FAILED names:
    the error the note quotes is that rank's own, the first it saw, not the run's first failure."""
    reason = note.removeprefix(STOPPED)
    quoted = [f for f in a.ctx.failures if f.reason == reason] if reason != note else []
    failure = min(quoted, key=lambda f: f.rank, default=None)  # (the notes are rank 0's scope's)
    if failure is None:
        return note
    cause = launch_failed(a, failure)
    if cause.ranks == (failure.rank,):
        return note
    what = _lost_connection(reason)
    what = what if len(what) <= 80 else f"{what[:80]}…"
    return f"{STOPPED}{cause.title} ({cause.code}); rank {failure.rank}'s own error followed: {what}"


def _failure(a: RunAnalysis, first: RankFailure, same: list[RankFailure]) -> Finding:
    if DIED in first.reason:
        return _died(a, first, same)
    others = [f for f in same if f.rank != first.rank]
    after = "" if first.last_step is None else f" after step {first.last_step}"
    left = LEFT in first.reason  # (it ended without finish() while another rank waited for it)
    what = first.reason.split(LEFT if left else RAISED, 1)[-1]
    title = (
        f"rank {first.rank} left the job{after} {what}"
        if left
        else f"rank {first.rank} failed{after}: {what}"
    )
    detail = (
        f"Rank {first.rank} left the job{after} {what}."
        if left
        else f"Rank {first.rank} raised {what}{after}."
    )
    if others:
        ranks = sorted({f.rank for f in others})
        then = others[0].reason.split(RAISED, 1)[-1]
        detail += (
            f" Rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)} raised after it "
            f"({then[:60]}{'…' if len(then) > 60 else ''}), most likely because rank {first.rank} had left."
        )
    lost = lost_a_peer(first.reason)  # (with no rank known to have gone first: a launch resumed past)
    if lost:
        detail += (
            " That error is a lost connection: another rank's process had ended first (killed, or it left the "
            "loop), with nothing recorded of its own."
        )
    detail += _ended(first)
    followed = ": the other ranks' errors followed from it." if a.world_size > 1 else "."
    if left:
        advice = (
            f"Find where rank {first.rank} ends early (a sys.exit() or return that one rank decides alone: a NaN "
            "guard, early stopping, a time limit): decide it on every rank together (all_reduce the flag), then "
            "exit the loop on all of them; the other ranks' errors followed."
        )
    elif lost:
        advice = (
            f"Rank {first.rank}'s error says another rank was gone: find the rank that ended first (torchrun's "
            '"Root Cause", each rank\'s exit code and log; -9 is SIGKILL, and the kernel log, `dmesg -T`, says '
            "where the out-of-memory killer struck)."
        )
    else:
        advice = f"Read rank {first.rank}'s traceback first (its own log; torchrun names the first failure too){followed}"
    return Finding(
        code="RUN.FAILED",
        severity=Severity.MED if first.resumed_past else Severity.HIGH,
        title=title[:160],
        detail=detail,
        recommendation=advice,
        ranks=(first.rank,),
        steps=() if first.last_step is None else (first.last_step,),
        evidence={"failed_ranks": len({f.rank for f in same})},
    )


def _died(a: RunAnalysis, first: RankFailure, same: list[RankFailure]) -> Finding:
    """RUN.FAILED for a rank a fatal signal ended, as the dump faulthandler wrote for it says."""
    rank, after = first.rank, "" if first.last_step is None else f" after step {first.last_step}"
    records = (
        " It died before its first gather."
        if first.last_step is None
        else f" Its records end at step {first.last_step}: later steps, if any, were never gathered."
    )
    what = first.reason.split(DIED, 1)[1]  # "SIGABRT in all_reduce, called from train.py line 91"
    others = sorted({f.rank for f in same if f.rank != rank})
    them = f"Rank{'s' if len(others) > 1 else ''} {format_ranks(others)}"
    followed = f" {them} raised after it, most likely because rank {rank} was gone." if others else ""
    if what.startswith("SIGABRT"):
        cause = (
            " SIGABRT is abort(): an error in C++ code ended the process, e.g. gloo's check that a "
            'collective received the size it expected ("Is there a distributed collective mismatch in your '
            'code?": the ranks called different collectives there, or the same one on tensors of different '
            "sizes), or NCCL's watchdog after a collective failed or timed out."
        )
        advice = (
            f"Read rank {rank}'s log just before it died: the C++ error (\"terminate called after throwing "
            '…" and its what()) says why. For a collective mismatch, compare the collectives the ranks call '
            "there: one that some ranks call and others do not (rank-dependent control flow), or tensors of "
            "different sizes; TORCH_DISTRIBUTED_DEBUG=DETAIL checks each collective's arguments across ranks."
        )
    else:
        cause = " A crash in native code: a C/C++ or CUDA extension, a library, the driver."
        advice = (
            f"Read rank {rank}'s log and its Python stacks (ranks/rank{rank}.fatal) for where it crashed."
        )
    return Finding(
        code="RUN.FAILED",
        severity=Severity.MED if first.resumed_past else Severity.HIGH,
        title=f"rank {rank} died{after}: {what}"[:160],
        detail=(
            f"{a.ctx.placement.describe(rank).capitalize()} died of {what}: a fatal signal, which no Python "
            f"code of the rank survives (its Python stacks as it died: ranks/rank{rank}.fatal).{cause}"
            f"{records}{followed}{_ended(first)}"
        ),
        recommendation=advice + (f" What {them.lower()} raised followed from it." if others else ""),
        ranks=(rank,),
        steps=() if first.last_step is None else (first.last_step,),
        evidence={"failed_ranks": len({f.rank for f in same})},
    )


def _gone_first(a: RunAnalysis, lost: RankFailure, same: list[RankFailure]) -> RankEnd | None:
    """The rank that `lost`'s collective lost its connection to: one whose records end, by that step, with no
    failure of its own: killed first (nothing said: gloo resets the connection the moment a process dies, so
    the survivors raise before any of them waits long enough to name it), then one that ended alone, each
    the earliest. None where the run's rank ends are not that launch's (the job was resumed past it)."""
    if lost.resumed_past:
        return None
    failed = {f.rank for f in same}
    gone = [
        e
        for e in a.rank_ends
        if e.rank not in failed
        and (e.reason in KILLED or ended_alone(e.reason))
        and (e.last_step is None or lost.last_step is None or e.last_step <= lost.last_step)
    ]
    return min(
        gone,
        key=lambda e: (e.reason not in KILLED, e.last_step is not None, e.last_step or 0, e.rank),
        default=None,
    )


def _peer_gone(a: RunAnalysis, gone: RankEnd, same: list[RankFailure]) -> Finding:
    """RUN.FAILED for a rank that died or left first, every failure recorded being a lost connection to it."""
    first, rank, killed = same[0], gone.rank, gone.reason in KILLED
    lost = sorted({f.rank for f in same})
    them = f"rank{'s' if len(lost) > 1 else ''} {format_ranks(lost)}"
    followed = f"{them} then lost {'their' if len(lost) > 1 else 'its'} connection to it"
    error = _lost_connection(first.reason) + (
        "" if first.last_step is None else f" after step {first.last_step}"
    )
    then = f" {them.capitalize()} then raised {error}: a collective's lost connection, which followed, not a failure of its own."
    who = a.ctx.placement.describe(rank).capitalize()
    if killed:
        records = "no records" if gone.last_step is None else f"records end at step {gone.last_step}"
        title = f"rank {rank} was killed or aborted (no error of its own; {records}); {followed}"
        detail = (
            f"{who} ended with no error and no reason of its own recorded: its process was most likely killed "
            "(SIGKILL: the out-of-memory killer, the scheduler, a user) or aborted (SIGABRT: an error in C++ "
            "code, e.g. gloo's on a collective mismatch). "
            + (
                "It died before its first gather."
                if gone.last_step is None
                else f"Its records end at step {gone.last_step}: later steps, if any, were never gathered."
            )
        )
        advice = (
            f"Find out why rank {rank}'s process died: its exit code (torchrun's \"Root Cause\" names it): -9 "
            "is SIGKILL (the kernel log on its host says where the out-of-memory killer struck: `dmesg -T | "
            "grep -i -E 'killed process|out of memory'`), -6 SIGABRT (its own log, just before, holds the C++ "
            'error: "terminate called after throwing …", e.g. a collective mismatch)'
        )
    else:
        where = "" if gone.last_step is None else f" after step {gone.last_step}"
        title = f"rank {rank} ended{where} without the other ranks ({gone.reason[:60]}); {followed}"
        detail = f"{who} ended{where} while the other ranks trained on, saying: {gone.reason}."
        advice = (
            f"Find what sent rank {rank} SIGTERM (a scheduler's preemption or time limit, a launcher, a user)"
            if gone.reason.startswith("SIGTERM")
            else f"Find why rank {rank} stopped before the others: fewer batches than theirs (give every rank "
            "as many: a DistributedSampler with drop_last=True, or torch's Join), or a stop that one rank "
            "decides alone (early stopping, a time limit, a sys.exit()): decide it on every rank together "
            "(all_reduce the flag)"
        )
    return Finding(
        code="RUN.FAILED",
        severity=Severity.MED if first.resumed_past else Severity.HIGH,
        title=title[:160],
        detail=detail + then + _ended(first),
        recommendation=f"{advice}. What {them} raised followed from it.",
        ranks=(rank,),
        steps=() if gone.last_step is None else (gone.last_step,),
        evidence={"failed_ranks": len(lost)},
    )


def _lost_connection(reason: str) -> str:
    """A lost connection's error, short: "RuntimeError: … Connection reset by peer" (gloo's own text starts with
    its source file and ends in a hint, cut)."""
    what = reason.split(RAISED, 1)[-1]
    kind = what.split(":", 1)[0] if ":" in what else ""
    said = next((text for text in PEER_GONE if text in what), None)
    return f"{kind}: … {said}" if said is not None and kind.isidentifier() else what


def _ended(first: RankFailure) -> str:
    return (
        " The job was resumed past it (restarts: the goodput line)."
        if first.resumed_past
        else " The run ended there."
    )


def _launch_of(f: RankFailure) -> object:
    return ("launch", f.segment) if f.segment is not None else ("went on", f.resumed_past)


# --- data --------------------------------------------------------------------------------------------------

INPUT_MIN_SHARE = 0.10
"""Data wait >= 10% of a rank's wall: below that, prefetching cannot win much."""
INPUT_MIN_MS = 1.0
"""...and >= 1 ms per step on average: a 0.3 ms in-memory fetch is not a data-loading problem. The mean, as
the share is: workers that prefetch deliver in bursts (81, 17, 66, 4, 92 ms ...), and a median wait under
1 ms can sit beside a loader that holds half of the wall time."""
INPUT_BURSTS = 0.5
"""A median wait under half the mean is said beside it: the phase table's medians then show little data wait."""
INPUT_MED_SHARE = 0.15
INPUT_HIGH_SHARE = 0.30
"""Severity by the worst rank's share: 15% MED, 30% HIGH."""


@rule("DATA.INPUT_BOUND")
def input_bound(a: RunAnalysis) -> list[Finding]:
    d = a.distributed
    ranks = [r for r in d.per_rank if r.data_share >= INPUT_MIN_SHARE and r.data_mean_ms >= INPUT_MIN_MS]
    if not ranks:
        return []
    worst = max(ranks, key=lambda r: r.data_share)
    share = worst.data_share
    sev = severity_at(share, INPUT_MED_SHARE, INPUT_HIGH_SHARE)
    some = len(ranks) < len(d.per_rank)
    if not some:
        who = "Every rank waits"
    elif len(ranks) == 1:
        who = f"Rank {ranks[0].rank} waits"
    else:
        who = f"Ranks {format_ranks(r.rank for r in ranks)} wait"
    most = f", rank {worst.rank} the largest share of its step" if len(ranks) > 1 else ""  # (the ms are its)
    bursts = (
        f" It comes in bursts: the median wait is {worst.data_ms:.2f} ms (the loader's workers run ahead, then "
        "fall behind)."
        if worst.data_ms < INPUT_BURSTS * worst.data_mean_ms
        else ""
    )
    return [
        Finding(
            code="DATA.INPUT_BOUND",
            severity=sev,
            title="Training waits for input data" + (" on some ranks" if some else ""),
            detail=(
                f"{who} for the next batch{most}: {worst.data_mean_ms:.2f} ms per step on average, "
                f"{_pct(share)} of its wall time.{bursts}"
            ),
            recommendation=(
                "Raise DataLoader num_workers and prefetch_factor while workers x ranks per host stay under "
                "its CPU cores (past that, make each sample cheaper: cache decoded data, augment on the "
                "device), set pin_memory=True and persistent_workers=True, and move decoding/augmentation off "
                "the main process; "
                + (
                    "check those ranks' storage and shards first."
                    if some
                    else "check storage throughput first."
                )
            ),
            ranks=tuple(r.rank for r in ranks) if some else (),
            evidence={"data_ms": worst.data_mean_ms, "data_median_ms": worst.data_ms, "data_share": share},
        )
    ]


DUPLICATE_MIN_CHECKED = 5
"""At least five fingerprinted steps (40 steps): one shared warm-up batch is not a sampler bug."""
DUPLICATE_MIN_REPEAT = 0.5
"""A rank repeats another's data in at least half the checked steps: persistent, not a coincidence."""
DUPLICATE_HIGH_SHARE = 0.25
"""A quarter of the job's compute or more spent on data another rank also trained on."""


@rule("DATA.DUPLICATE_SHARDS")
def duplicate_shards(a: RunAnalysis) -> list[Finding]:
    """Ranks training on identical batches (no DistributedSampler, or one seeded the wrong way)."""
    d = a.duplicates
    ranks = [
        int(r) for r, share in zip(d.ranks, d.repeat_share, strict=True) if share >= DUPLICATE_MIN_REPEAT
    ]
    if d.steps_checked < DUPLICATE_MIN_CHECKED or len(ranks) < 2:
        return []
    groups = "; ".join(
        f"{len(g) - 1} of {a.world_size} ranks ({format_ranks(g[1:])}) repeat rank {g[0]}'s data"
        for g in d.groups
    )
    share = max(d.repeat_share)
    return [
        Finding(
            code="DATA.DUPLICATE_SHARDS",
            severity=Severity.HIGH if d.duplicated_share >= DUPLICATE_HIGH_SHARE else Severity.MED,
            title="Ranks train on the same data",
            detail=(
                f"Ranks {format_ranks(ranks)} saw identical batches in up to {_pct(share)} of "
                f"{d.steps_checked} checked steps (every 8th step is fingerprinted)"
                + (f"; in the last one {groups}" if groups else "")
                + f": {_pct(d.duplicated_share)} of the job's compute repeats work another rank did."
            ),
            recommendation=(
                "Give each rank its own shard: a DistributedSampler (Lightning: use_distributed_sampler=True; "
                "Accelerate: pass the DataLoader to accelerator.prepare), or seed each rank's shuffling with its "
                "rank. An IterableDataset takes no sampler (Lightning's flag leaves it as it is): split its "
                "stream by rank in its __iter__ (e.g. itertools.islice(stream, rank, None, world_size), or one "
                "file per rank). If these ranks are meant to share batches (tensor or pipeline parallel), "
                "ignore this."
            ),
            ranks=tuple(ranks),
            evidence={"duplicated_share": d.duplicated_share, "steps_checked": float(d.steps_checked)},
        )
    ]


JOIN_WAIT_MED_SHARE = 0.05
"""A rank idle inside a join for a twentieth of the run costs the job what a 5% slower rank would (a
straggler of that size is a finding too), and the steps it missed trained on fewer ranks' data."""


@rule("DATA.UNEVEN_SHARDS")
def uneven_inputs(a: RunAnalysis) -> list[Finding]:
    """Ranks that ran out of batches and waited inside torch's Join while the others trained on: measured,
    where the check at start (shards.py) predicts it from the loaders' lengths. One finding per rank."""
    out = []
    for w in a.join_waits:
        epochs = f" (in {w.joins} joins)" if w.joins > 1 else ""
        out.append(
            Finding(
                code="DATA.UNEVEN_SHARDS",
                severity=Severity.MED if w.share >= JOIN_WAIT_MED_SHARE else Severity.LOW,
                title=f"Rank {w.rank} ran out of batches first and waited inside join()",
                detail=(
                    f"Rank {w.rank} had no batch after step {w.last_step}: it waited inside torch's Join "
                    f"(uneven inputs) through {w.steps_missed} steps the other ranks took{epochs}, "
                    f"{w.wait_s:.3g} s ({_pct(w.share)} of the run's wall time), and gave no gradients to them."
                ),
                recommendation=(
                    "If the unevenness is not intended, give every rank the same number of batches "
                    "(DistributedSampler(drop_last=True); Accelerate: even_batches=True). If it is, those steps "
                    "average fewer ranks' gradients, still divided by the whole world size unless "
                    "divide_by_initial_world_size=False is passed to join()."
                ),
                ranks=(w.rank,),
                steps=(w.last_step,),
                evidence={"steps_missed": float(w.steps_missed), "wait_s": w.wait_s, "share": w.share},
            )
        )
    return out


# --- convergence -------------------------------------------------------------------------------------------


@rule("CONVERGENCE.NONFINITE")
def nonfinite(a: RunAnalysis) -> list[Finding]:
    """The first NaN/Inf loss, and whether the loss was ever finite again (`convergence.nonfinite_tail`). No
    floor: one non-finite loss poisons the weights."""
    c = a.convergence
    if c.nonfinite_step is None:
        return []
    tail = c.nonfinite_tail
    evidence = {"step": float(c.nonfinite_step), "nonfinite_steps": float(c.nonfinite_steps)}
    if tail is None:
        title = f"The loss became non-finite at step {c.nonfinite_step}"
        course = (
            f" The run's last {c.nonfinite_last_steps} step(s) had a non-finite loss ({c.nonfinite_steps} in all):"
            " too few to tell whether it would have recovered."
            if c.nonfinite_last_steps
            else f" It was finite again after it ({c.nonfinite_steps} step(s) in all had a non-finite loss)."
            if c.nonfinite_steps
            else ""
        )
    else:
        evidence |= {"nonfinite_to_end_step": float(tail.step), "nonfinite_to_end_steps": float(tail.steps)}
        title = f"The loss became non-finite at step {c.nonfinite_step}" + (
            " and never recovered" if tail.step == c.nonfinite_step else f", for good from step {tail.step}"
        )
        # Some ranks' losses stayed finite: their mean is no sign that it trained (a rank's NaN gradients
        # reach every rank through the all-reduce).
        some = bool(tail.ranks) and 1 < a.world_size and len(tail.ranks) < a.world_size
        course = (
            f" {f'The loss of rank(s) {format_ranks(tail.ranks)}' if some else 'The loss'} stayed non-finite "
            f"from step {tail.step} to the end ({tail.steps} step(s) with a non-finite loss"
            + ("" if tail.stepped else ", and no optimizer step updated the weights again")
            + ")"
            + ("; the other ranks' finite losses do not mean that it trained." if some else ".")
        )
    return [
        Finding(
            code="CONVERGENCE.NONFINITE",
            severity=Severity.HIGH,
            title=title,
            detail=(
                f"First NaN/Inf loss at step {c.nonfinite_step} on rank(s) {format_ranks(c.nonfinite_ranks)}"
                + (
                    f"; the last finite loss before it was {c.loss_before_nonfinite:.4g}"
                    + (" (the mean over ranks)." if a.world_size > 1 else ".")
                    if math.isfinite(c.loss_before_nonfinite)
                    else "."
                )
                + course
            ),
            recommendation=(
                "Lower the learning rate or add warm-up, clip gradients, and check the batch at that step "
                "for bad values; under fp16 use a GradScaler (or bf16)."
                + (
                    f" A loss that stays non-finite does not recover: restart from a checkpoint saved before step "
                    f"{tail.step}."
                    if tail is not None
                    else ""
                )
            ),
            ranks=c.nonfinite_ranks,
            steps=(c.nonfinite_step,),
            evidence=evidence,
        )
    ]


@rule("CONVERGENCE.SKIPPED_STEPS")
def skipped_steps(a: RunAnalysis) -> list[Finding]:
    """Steps no optimizer step trained while the loss stayed finite (`convergence.skipped_steps`, floors
    there): HIGH when none trained from some step to the end, MED for a large share of the run."""
    x = a.convergence.skipped
    if x is None:
        return []
    causes = (
        "a GradScaler skips each step whose gradients hold inf or NaN (with a finite loss: an op whose backward "
        "is not finite, as sqrt or a norm at 0, or an fp16 overflow in the backward only); a guard that skips "
        "the optimizer step; a Lightning training_step that returned None"
    )
    evidence = {
        "skipped_steps": float(x.steps),
        "counted_steps": float(x.counted),
        "late_skipped_steps": float(x.late_steps),
        "late_counted_steps": float(x.late_counted),
        "first_step": float(x.first_step),
    }
    if x.tail_step is not None:
        evidence |= {"tail_step": float(x.tail_step), "tail_steps": float(x.tail_steps)}
        severity = Severity.HIGH
        title = f"No optimizer step has trained the model since step {x.tail_step}"
        detail = (
            f"From step {x.tail_step} to step {x.last_step} ({x.tail_steps} steps) no rank's optimizer stepped "
            "on a backward, while the loss stayed finite: the weights have not changed since."
        )
        advice = (
            f"Find the first non-finite gradient: from a checkpoint before step {x.tail_step}, check each "
            "parameter's .grad with torch.isfinite after the backward (or run a few steps under "
            "torch.autograd.detect_anomaly()); under fp16, try bf16; where a guard skips, log why."
        )
    else:
        severity = Severity.MED
        title = f"The optimizer skipped {x.steps} of {x.counted} steps"
        detail = (
            f"{_pct(x.steps / x.counted)} of the steps past warm-up ({_pct(x.late_steps / x.late_counted)} of "
            "their second half) trained nothing (no rank's optimizer stepped on a backward) while the loss stayed "
            f"finite; the first at step {x.first_step}, the last at step {x.last_step}."
        )
        advice = (
            "A GradScaler that skips this often raises its scale into overflow again and again: raise its "
            "growth_interval (or use bf16, which needs no scaler); where gradients are non-finite now and then, "
            "find which parameter's .grad is (torch.isfinite after the backward); where a guard skips, log why."
        )
    return [
        Finding(
            code="CONVERGENCE.SKIPPED_STEPS",
            severity=severity,
            title=title,
            detail=f"{detail} Causes: {causes}.",
            recommendation=advice,
            steps=(x.tail_step if x.tail_step is not None else x.first_step,),
            evidence=evidence,
        )
    ]


SPIKE_MED_COUNT = 3
"""Three or more spikes (or one that doubles the loss, far out of its noise) make it MED: the run is unstable,
not unlucky."""
SPIKE_MED_RATIO = 2.0
SPIKE_MED_SIGMAS = 12.0
"""...far out: twice the detection floor (convergence.SPIKE_MADS). A converged cross-entropy's batches swing
to x3.8 its median at 7 sigmas in a healthy run; a real blow-up goes much further (x10 there: 22 sigmas)."""


@rule("CONVERGENCE.SPIKE")
def spike(a: RunAnalysis) -> list[Finding]:
    """Floors live in convergence.py: >= 6 robust sigmas and >= 25% above the local level (the trailing
    window's, at its trend)."""
    spikes = a.convergence.spikes
    if not spikes:
        return []
    worst = max(spikes, key=lambda s: s.loss / s.baseline if s.baseline > 0 else math.inf)
    ratio = worst.loss / worst.baseline if worst.baseline > 0 else math.inf
    far = any(s.loss >= SPIKE_MED_RATIO * s.baseline > 0 and s.sigmas >= SPIKE_MED_SIGMAS for s in spikes)
    sev = Severity.MED if len(spikes) >= SPIKE_MED_COUNT or far else Severity.LOW
    listed = ", ".join(str(s.step) for s in spikes[:10]) + (" ..." if len(spikes) > 10 else "")
    return [
        Finding(
            code="CONVERGENCE.SPIKE",
            severity=sev,
            title=f"{len(spikes)} loss spike(s)",
            detail=(
                f"Loss jumped well above its local level at step(s) {listed}; the largest went "
                f"from {worst.baseline:.4g} to {worst.loss:.4g} (x{ratio:.2f}"
                + (", the mean over ranks" if a.world_size > 1 else "")
                + f") at step "
                f"{worst.step}" + (f", on rank(s) {format_ranks(worst.ranks)} only." if worst.ranks else ".")
            ),
            recommendation=(
                "Inspect the batches at those steps for outliers"
                + (
                    " (a spike on some ranks only is in their batches: their shard of the data)"
                    if worst.ranks
                    else ""
                )
                + "; if spikes recur, lower the learning rate, clip gradients, or raise Adam's epsilon."
            ),
            ranks=worst.ranks,
            steps=tuple(s.step for s in spikes[:50]),
            evidence={"count": float(len(spikes)), "max_ratio": ratio},
        )
    ]


@rule("CONVERGENCE.NO_PROGRESS")
def no_progress(a: RunAnalysis) -> list[Finding]:
    """A "flat" (MED) or "worsening" (HIGH) trend; a loss that fell and turned up (MED, `rise_start`); an
    improving one that went flat (LOW, `plateau_start`);
    the floors (t >= 3.9 one-sided, >= 5% change, >= 100 finite steps) live in convergence.py."""
    t = a.convergence.trend
    plateau = a.convergence.plateau
    rise = a.convergence.rise
    if rise is not None:
        return [
            Finding(
                code="CONVERGENCE.NO_PROGRESS",
                severity=Severity.MED,
                title=f"The loss has been rising since around step {rise.step}",
                detail=(
                    f"Its smoothed loss stayed near its lowest ({rise.lowest:.4g}) until about step {rise.step} "
                    f"and ended at {rise.last:.4g} ({_pct((rise.last - rise.lowest) / abs(rise.lowest))} above "
                    f"it), a significant rise (t = {rise.t:.1f}); the run as a whole reads as {t.trend} only "
                    "because of its earlier fall."
                ),
                recommendation=(
                    "A training loss that turns up after falling usually means the learning rate is too high for this "
                    "stage (lower or decay it; check the schedule's peak and warm-up) or the data changed (a new "
                    "epoch's order, shards of a different kind); look at the gradient norm around that step and clip "
                    "it if it grows. Keep the checkpoint from before the turn."
                ),
                steps=(rise.step,),
                evidence={"rise_step": rise.step, "relative_change": rise.relative_change, "t": rise.t},
            )
        ]
    if t.trend in ("improving", "unclear") and plateau is not None:
        return [
            Finding(
                code="CONVERGENCE.NO_PROGRESS",
                severity=Severity.LOW,  # what a run that converged looks like: a hint, not a fault
                title=f"The loss stopped improving around step {plateau.step}",
                detail=(
                    f"From step {plateau.step} on ({plateau.steps} counted steps) the loss changed by "
                    f"{100 * plateau.relative_change:+.1f}% (at most ±{100 * plateau.bound:.1f}% with confidence), "
                    f"after a fall of {100 * plateau.fall:.0f}% from the level of the run's first quarter."
                ),
                recommendation=(
                    "If the model has converged, stop (or save compute with early stopping); if it should still "
                    "learn, lower the learning rate (a decay schedule or ReduceLROnPlateau) or check that the "
                    "schedule did not already reach zero."
                ),
                steps=(plateau.step,),
                evidence={"plateau_step": plateau.step, "relative_change": plateau.relative_change},
            )
        ]
    if t.trend not in ("flat", "worsening"):
        return []
    worse = t.trend == "worsening"
    return [
        Finding(
            code="CONVERGENCE.NO_PROGRESS",
            severity=Severity.HIGH if worse else Severity.MED,
            title="The loss is getting worse" if worse else "The loss has stopped improving",
            detail=(
                f"Over {t.finite_steps} counted steps the mean loss of the last quarter differs from the first "
                f"quarter by {_pct(t.relative_change)} (t = {t.t:.1f}); "
                + ("a significant rise." if worse else "no significant decrease of at least 5%.")
            ),
            recommendation=(
                "Check the learning-rate schedule and that the optimizer steps the right parameters (no frozen "
                "or detached model); if the model has converged, stop or lower the learning rate."
            ),
            evidence={"relative_change": t.relative_change, "t": t.t},
        )
    ]


# --- timing and memory -------------------------------------------------------------------------------------

JITTER_P95_RATIO = 1.5
"""p95 step >= 1.5x the median: steps are not just noisy but sometimes much slower."""
JITTER_MIN_COST = 0.05
"""Time above the median step >= 5% of wall: the slow steps must cost something."""
JITTER_MED_COST = 0.15
JITTER_MIN_STEPS = 20


@rule("TIMING.JITTER")
def jitter(a: RunAnalysis) -> list[Finding]:
    t = a.timing
    if t.steps_counted < JITTER_MIN_STEPS or not t.median_ms > 0:
        return []
    ratio = t.p95_ratio
    cost = t.jitter_cost_share - t.stall_share  # stalled steps are TIMING.STALL's, not counted twice
    if not ratio >= JITTER_P95_RATIO or cost < JITTER_MIN_COST:
        return []
    who = a.distributed.intermittent  # (None where communication is not measured)
    span = a.distributed.late or a.distributed.ended
    if who is not None and span is not None and who.rank in span.stragglers:
        who = (
            None  # slow in every step since it began, or until it stopped (DIST.STRAGGLER), not now and then
        )
    if who is not None:
        every = f", every {who.every} steps" if who.every else ""
        where = (
            f" Rank {who.rank} makes {who.steps} of the {who.slow_steps} steps of 1.5x the median slow{every}: "
            f"its own work grows by {who.extra_ms:.2f} ms there, most in `{who.phase}`, while the other ranks "
            "wait for it."
        )
        advice = (
            f"Find what rank {who.rank} does in `{who.phase}` on those steps (step numbers: `pytscope trace`): "
            "work on one rank only (logging, metrics, checkpointing, evaluation on rank 0), a batch much larger "
            "than the others' (variable-length samples: bucket or pack them), garbage collection, another job "
            "on its host. Move it off the step, make it asynchronous, or spread it over the ranks."
        )
    else:
        where = (
            f" In the slowest 10% of steps `{t.jitter_phase}` grows the most (+{t.jitter_phase_ms:.2f} ms)."
            if t.jitter_phase
            else ""
        )
        advice = (
            "Look for periodic work inside steps (logging, checkpointing, garbage collection, data loader "
            "worker restarts) and for other jobs sharing the host; `pytscope trace` shows which phase grows."
        )
    return [
        Finding(
            code="TIMING.JITTER",
            severity=Severity.MED if cost >= JITTER_MED_COST else Severity.LOW,
            title=f"Step time is unstable: rank {who.rank} is slow now and then"
            if who
            else "Step time is unstable",
            detail=(
                f"p95 step x{ratio:.2f} the median step ({t.p95_ms:.2f} vs {t.median_ms:.2f} ms); time above "
                f"the median step is {_pct(cost)} of wall"
                + (" (stalled steps aside)." if t.stall_share > 0 else ".")
                + where
            ),
            recommendation=advice,
            ranks=(who.rank,) if who else (),
            evidence={
                "p95_ratio": ratio,
                "cost_share": cost,
                "phase_growth_ms": t.jitter_phase_ms,
                **({"rank_extra_ms": who.extra_ms} if who else {}),
            },
        )
    ]


STALL_MIN_SHARE = 0.05
"""Stalled steps (>= 10x the median step and >= 100 ms, analysis/timing.py) cost >= 5% of wall time..."""
STALL_MED_SHARE = 0.10
"""...MED from 10%."""
_STALL_ADVICE = {
    "other": "work outside forward, backward and the optimizer step (before optimizer.step() or after it): "
    "checkpoint saving, evaluation or logging to disk in the training loop. Put it inside `scope.paused()` (it "
    "is then not charged to training), and save asynchronously where you can "
    "(torch.distributed.checkpoint.async_save)",
    "data": "the input pipeline stopped: a loader's workers restarting (persistent_workers=True), slow or "
    "remote storage, a shuffle buffer refilling",
    "forward": "a recompilation (a new input shape or a guard failing under torch.compile: TORCH_LOGS="
    "recompiles), a first use of a code path, or the host swapping",
    "backward": "a recompilation of the backward, a first use of a code path, or memory pressure (allocator "
    "retries: see MEMORY findings)",
    "optimizer": "the optimizer's own periodic work (a scheduler or an optimizer that does extra work every N "
    "steps), or a first step allocating its state",
    "comm": "the collective itself stalled on every rank (the network, NCCL/gloo, a peer outside the job)",
}


@rule("TIMING.STALL")
def stall(a: RunAnalysis) -> list[Finding]:
    """A few steps took many times the median and together a real share of wall time."""
    t = a.timing
    reported = _stalls_reported_as_hangs(a)
    early = [x for x in t.warm_up_stalls if x.step in reported]
    out = [_start_up_stall(a, early, reported)] if early else []
    if not t.stalls or t.stall_share < STALL_MIN_SHARE:
        return out
    worst = t.stalls[0]
    where = _stall_where(a, worst)
    listed = ", ".join(str(s.step) for s in t.stalls)
    hangs = {step: i for step, i in reported.items() if any(x.step == step for x in t.stalls)}
    seen_as_hang = ""
    if hangs:
        first = _hang_reports(a)[hangs[min(hangs)]]
        seen_as_hang = (
            f" The watchdog reported step{'s' if len(hangs) > 1 else ''} {', '.join(map(str, sorted(hangs)))} as "
            f"a hang at the time ({first.title}; stacks/ holds where every rank was), and every rank then went "
            "on: a stall, not a hang."
        )
    severity = Severity.MED if t.stall_share >= STALL_MED_SHARE or hangs else Severity.LOW
    return out + [
        Finding(
            code="TIMING.STALL",
            severity=severity,
            title=f"Step {worst.step} stalled for {worst.wall_ms / 1e3:.1f} s",
            detail=(
                f"Step {worst.step} took {worst.wall_ms / 1e3:.2f} s, {worst.wall_ms / t.median_ms:.0f}x the median "
                f"step: {where}. Steps of at least 10x the median ({listed}"
                f"{f' and {t.stall_count - len(t.stalls)} more' if t.stall_count > len(t.stalls) else ''}) cost "
                f"{_pct(t.stall_share)} of wall time beyond a median step.{seen_as_hang}"
            ),
            recommendation=f"Likely {_STALL_ADVICE[worst.phase]}. Pauses at irregular intervals in any phase "
            "can also be Python's garbage collector: call gc.freeze() once the model and loaders are built.",
            ranks=(worst.rank,),
            steps=tuple(s.step for s in t.stalls),
            evidence={"stall_share": t.stall_share, "wall_ms": worst.wall_ms, "phase_ms": worst.phase_ms},
        )
    ]


def _stall_where(a: RunAnalysis, worst: Stall) -> str:
    """Who held the stalled step up, and where."""
    where = f"rank {worst.rank} spent {worst.phase_ms / 1e3:.2f} s in `{worst.phase}`"
    if worst.phase == "comm":
        return (
            f"every rank waited in communication, rank {worst.rank} the least ({worst.phase_ms / 1e3:.2f} s)"
        )
    if worst.others_waited and a.world_size > 1:
        where += f" while the other rank{'s' if a.world_size > 2 else ''} waited for it"
    return where


def _start_up_stall(a: RunAnalysis, early: list[Stall], reported: dict[int, int]) -> Finding:
    """TIMING.STALL of warm-up steps the watchdog reported as a hang that every rank went on past (a
    hang_timeout shorter than start-up): slow start-up, not a hang. Warm-up is otherwise not judged, so this
    is said whatever its share of wall time, as the hang it replaces would have been."""
    worst = max(early, key=lambda x: x.wall_ms)
    steps = sorted(x.step for x in early)
    first = _hang_reports(a)[reported[steps[0]]]
    ratio = f", {worst.wall_ms / a.timing.median_ms:.0f}x the median step" if a.timing.median_ms > 0 else ""
    return Finding(
        code="TIMING.STALL",
        severity=Severity.MED,
        title=f"Step {worst.step} stalled for {worst.wall_ms / 1e3:.1f} s in warm-up",
        detail=(
            f"Step {worst.step} took {worst.wall_ms / 1e3:.2f} s{ratio}: {_stall_where(a, worst)}. The watchdog "
            f"reported step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))} as a hang at the time "
            f"({first.title}; stacks/ holds where every rank was), and every rank then went on: slow start-up, "
            "longer than the hang_timeout set, not a hang. Warm-up steps are otherwise left out of the timing "
            "statistics: start-up work is expected there."
        ),
        recommendation=(
            "Likely start-up work on the first steps (lazy initialisation, compilation, loaders starting, a first "
            "checkpoint): nothing to fix if it comes once per launch. Set hang_timeout above it, or leave it "
            '"auto": in warm-up, only ranks stuck 5 minutes inside a collective that another rank never reached '
            "make a hang."
        ),
        ranks=(worst.rank,),
        steps=tuple(steps),
        evidence={"wall_ms": worst.wall_ms, "phase_ms": worst.phase_ms},
    )


GROWTH_MIN_RELATIVE = 0.10
"""Peak memory up >= 10% from the first to the last quarter of the run..."""
GROWTH_MIN_BYTES = 64 * 2**20
"""...and by >= 64 MiB: allocator caching moves by less."""
GROWTH_MIN_T = 3.9
"""...and significantly (same one-sided test as the loss trend)."""
GROWTH_MAX_RISE_SHARE = 0.4
"""...and spread out: no single rise between consecutive twentieths of the run holds 40% of it (a one-off peak
lifts a high-water mark in one place, or two when it falls inside a block; a leak climbs in every block)."""
GROWTH_MED_RELATIVE = 0.25


@rule("MEMORY.GROWTH")
def memory_growth(a: RunAnalysis) -> list[Finding]:
    m = a.memory
    if not (
        m.growth_relative >= GROWTH_MIN_RELATIVE
        and m.growth_bytes >= GROWTH_MIN_BYTES
        and m.growth_t >= GROWTH_MIN_T
        and m.largest_rise_share < GROWTH_MAX_RISE_SHARE
    ):
        return []
    return [
        Finding(
            code="MEMORY.GROWTH",
            severity=Severity.MED if m.growth_relative >= GROWTH_MED_RELATIVE else Severity.LOW,
            title="Memory keeps climbing",
            detail=(
                f"Per-step peak memory rose by {m.growth_bytes / 2**20:.0f} MiB ({_pct(m.growth_relative)}) "
                f"from the first to the last quarter of the run (t = {m.growth_t:.1f}); peak "
                f"{m.peak_bytes / 2**30:.2f} GiB on rank {m.peak_rank}."
            ),
            recommendation=(
                "Look for tensors kept across steps first: losses accumulated without .item()/.detach(), "
                "growing lists of outputs or metrics, caches keyed by input shape."
            ),
            ranks=(m.peak_rank,) if m.peak_rank is not None else (),
            evidence={"growth_bytes": m.growth_bytes, "growth_relative": m.growth_relative},
        )
    ]


PRESSURE_MED = 0.90
"""Peak >= 90% of the device/host limit: fragmentation or a longer batch can push it over."""
PRESSURE_HIGH = 0.97


@rule("MEMORY.PRESSURE")
def memory_pressure(a: RunAnalysis) -> list[Finding]:
    m = a.memory
    if m.peak_fraction is None or not m.peak_fraction >= PRESSURE_MED or not m.limit_bytes:
        return []
    limit = m.limit_bytes
    ranks = tuple(r for r, p in zip(m.ranks, m.rank_peaks, strict=True) if p / limit >= PRESSURE_MED)
    return [
        Finding(
            code="MEMORY.PRESSURE",
            severity=Severity.HIGH if m.peak_fraction >= PRESSURE_HIGH else Severity.MED,
            title="Memory is close to the limit",
            detail=(
                f"Peak {m.peak_bytes / 2**30:.2f} GiB on rank {m.peak_rank} is {_pct(m.peak_fraction)} of "
                f"the {limit / 2**30:.2f} GiB limit."
            ),
            recommendation=(
                "Reduce the micro-batch size and use gradient accumulation, enable activation checkpointing, "
                "or use bf16; set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation."
            ),
            ranks=ranks,
            evidence={"peak_bytes": m.peak_bytes, "peak_fraction": m.peak_fraction},
        )
    ]


# --- efficiency --------------------------------------------------------------------------------------------

RECOVERABLE_MIN_TOTAL = 0.10
"""Only speak when >= 10% of wall is recoverable in total..."""
RECOVERABLE_MIN_LINE = 0.05
"""...and name the lines that are >= 5% each."""
RECOVERABLE_MED_TOTAL = 0.5
"""MED from half of wall: the step is then mostly not training compute (a healthy run is compute-dominated)."""
_LINE_OF = {"data": "data wait", "comm": "exposed transfer", "other": "other"}
"""The budget line a phase's time falls in, where the line is recoverable."""
_ADVICE = {
    "data wait": "faster input pipeline (more workers, prefetch)",
    "exposed transfer": "more comm/compute overlap or fewer syncs",
    "sync wait (imbalance)": "balance the ranks' work (see straggler findings)",
    "optimizer": "a faster optimizer step: its foreach or fused implementation (e.g. AdamW(fused=True) on "
    "CUDA), fewer parameter groups, no host syncs (.item(), .cpu()) in a custom step, sharded optimizer state",
    "other": "look at what runs between the phases: a loss computed outside the model (its forward, and its "
    "backward up to the model's output, are `other`: a large one is real work, e.g. a fused or chunked cross-"
    "entropy), per-step reads of tensors (.item(), .cpu() wait for the device), metrics and logging, callbacks, "
    "gradient clipping by hand, copies of the batch to the device (pin_memory=True, non_blocking=True)",
}


def _advice(line: str, a: RunAnalysis) -> str:
    """What to do about a budget line; `other` that is mostly one straggler's extra work says so (its stalls first,
    where they cost more than its usual lag)."""
    d = a.distributed.effective
    t = a.timing
    stalled = t.stall_share >= STALL_MIN_SHARE and bool(t.stalls)
    # The larger bill first: a stall on the straggler's rank fills the lines its usual lag fills, many times over.
    stalls_first = stalled and t.stall_share > d.cost_share
    if len(d.stragglers) == 1 and line in ("other", "sync wait (imbalance)") and not stalls_first:
        slow = d.rank(d.stragglers[0])  # the others' wait is its extra work: one piece of advice for both
        if line == "sync wait (imbalance)" or slow.extra_phase == "other" and slow.extra_phase_ms > 0:
            where = f" in `{slow.extra_phase}`" if slow.extra_phase and slow.extra_phase_ms > 0 else ""
            until = f" until step {d.until}" if d.until is not None else ""
            return f"the extra work{where} on rank {slow.rank}, the straggler{until} (see DIST.STRAGGLER)"
    waits_for_stalls = line == "sync wait (imbalance)" and (stalls_first or not d.stragglers)
    if stalled and (waits_for_stalls or line == _LINE_OF.get(t.stalls[0].phase)):
        return f"the stalled step{'s' if len(t.stalls) > 1 else ''} (see TIMING.STALL)"
    if line == "sync wait (imbalance)" and not d.stragglers and d.intermittent is not None:
        return f"rank {d.intermittent.rank}'s slow steps, which the others wait for (see TIMING.JITTER)"
    if line == "exposed transfer" and (a.ctx.parallelism or "").startswith("fsdp2"):
        if a.world_size < 2:
            return "fewer sharded units, or no fully_shard on one rank (its brackets hold FSDP's own copies)"
        return "more prefetch, fewer and larger sharded units, or reshard_after_forward=False (see DIST.COMM_BOUND)"
    if line == "other" and a.ctx.integration == "lightning":
        return _OTHER_UNDER_LIGHTNING
    return _ADVICE[line]


_OTHER_UNDER_LIGHTNING = (
    "look at what runs between the phases (training_step's loss is timed as forward and backward already): "
    "per-step reads of tensors (.item(), .cpu() wait for the device; self.log(..., sync_dist=True) syncs "
    "every rank), metrics and logging every step (log_every_n_steps), callbacks, gradient clipping, copies of "
    "the batch to the device (pin_memory=True)"
)


@rule("EFFICIENCY.RECOVERABLE")
def recoverable(a: RunAnalysis) -> list[Finding]:
    e = a.efficiency
    lines = sorted(
        (x for x in e.budget if x.recoverable and x.share >= RECOVERABLE_MIN_LINE), key=lambda x: -x.share
    )
    if e.recoverable_share < RECOVERABLE_MIN_TOTAL or not lines:
        return []
    listed = "; ".join(f"{x.name} {_pct(x.share)} ({x.ms_per_step:.2f} ms/step)" for x in lines)
    return [
        Finding(
            code="EFFICIENCY.RECOVERABLE",
            severity=Severity.MED if e.recoverable_share >= RECOVERABLE_MED_TOTAL else Severity.LOW,
            title=f"{_pct(e.recoverable_share)} of wall time is recoverable",
            detail=f"Largest recoverable lines of the wall-time budget: {listed}.",
            recommendation="Start with the largest line: "
            + "; then ".join(dict.fromkeys(_advice(x.name, a) for x in lines))  # each piece of advice once
            + ".",
            evidence={x.name: x.share for x in lines},
        )
    ]


MFU_LOW = 0.30
"""Below 30% of peak there is usually room (well-tuned dense training reaches 35-55%)."""
MFU_MED = 0.10
"""Below 10% the device is mostly idle or the model too small for it."""


@rule("EFFICIENCY.LOW_MFU")
def low_mfu(a: RunAnalysis) -> list[Finding]:
    mfu = a.efficiency.mfu
    if mfu is None or not mfu < MFU_LOW:
        return []
    return [
        Finding(
            code="EFFICIENCY.LOW_MFU",
            severity=Severity.MED if mfu < MFU_MED else Severity.LOW,
            title=f"Model FLOPs utilisation is {_pct(mfu)}",
            detail=(
                f"{a.ctx.flops_per_step:.3g} FLOPs per step in {a.timing.mean_ms:.2f} ms (mean) on a device "
                f"with a {a.ctx.peak_flops:.3g} FLOP/s peak ({a.ctx.device})."
            ),
            recommendation=(
                "Raise the per-device batch size, use "
                + ("" if a.ctx.precision == "bf16" else "bf16 autocast and ")
                + "fused kernels (torch.compile, flash attention), and fix the largest recoverable budget line "
                "first."
            ),
            evidence={"mfu": mfu},
        )
    ]
