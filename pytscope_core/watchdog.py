"""Hang detection: a heartbeat thread on every rank, and rank 0 telling a hang from slowness.

Each rank's thread publishes (step, phase, seconds without progress, gradient syncs) to the key-value store
torch.distributed already has, whatever its main thread is doing — blocked in an all-reduce included.
Progress means a new timeline mark. The beat period grows with the world size (`beat_period`), so the
writes to the store stay bounded per second at any scale; rank 0 reads the other ranks' heartbeats (in one
`multi_get`) only while it has itself made no progress for `hang_timeout`, since until then there is no hang.
When no rank has progressed for `hang_timeout` seconds, rank 0 splits
the ranks into those waiting in a collective it times and those that never reached it (or, where none waits
in one, those behind the others in the step), writes DIST.HANG, and raises a flag in the store; every rank
then dumps all its threads' Python stacks into the run directory and, with on_hang="abort", exits non-zero
so the launcher can restart the job in minutes instead of after the collective timeout. Every rank idle at
one place, none in a timed collective, proves no hang (slow work looks the same): that is said (MED), the
stacks are dumped, and nobody exits. Watching goes on after any report that did not end the job.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .coordinator import STORE_ERRORS
from .findings import Finding, Severity, format_ranks
from .output import say, say_last
from .placement import Placement, local_place
from .recorder import StepRecorder
from .timeline import Mark

# Bound at import: user code and tests that patch `time.monotonic` / `time.time` must not move our clocks.
_monotonic = time.monotonic
_wall = time.time

HANG_EXIT_CODE = 86
BEAT_S = 1.0  # shortest heartbeat period: hang detection resolves to about this on small jobs
STORE_BEATS_PER_S = 1000.0
"""All ranks' heartbeats together write at most this many keys per second (and rank 0 reads as many): a
TCPStore serves tens of thousands of small requests per second, and the job's own rendezvous shares it."""
BEATS_PER_TIMEOUT = 4.0
"""...but every rank beats at least this often per hang_timeout, so a hang is named at most about a quarter
of the timeout late, whatever the world size."""
STOP_WAIT_S = 5.0  # at finish, how long to wait for a store call in flight before leaving the thread
AUTO_MIN_S = 120.0  # "auto" timeout floor: startup, compilation and first checkpoints stay clear of it
AUTO_STEP_FACTOR = 20.0  # "auto" timeout: this many times the slowest step seen after warm-up
AUTO_WARMUP_S = 300.0
""""auto" during warm-up, when step times say nothing yet (compilation, loader start-up, first checkpoints):
only ranks stuck this long inside a collective that another rank never reached make a hang. Every rank
compiling or loading never does, nor every rank inside one collective (a compile can sit between an FSDP2
unit's collective marks)."""
PAUSE_FACTOR = 4.0  # a rank paused (validation, checkpoint) gets this many timeouts before it counts as stuck
DUMP_WAIT_S = 5.0  # how long the aborting ranks wait for the others' stack dumps
END_WAIT_S = DUMP_WAIT_S + 5.0  # ...and the other ranks for rank 0's word that it ends

LOOP_COLLECTIVE = "a collective of the loop's"
JOINED = "join(), out of batches"  # shadowing the others' collectives inside torch's Join (joins.py)
WAITING_PHASES = (
    "comm",
    "gather",
    "collective",
    LOOP_COLLECTIVE,
    JOINED,
)  # blocked in a collective, waiting for peers
# The warm-up rule's: pytscope's own gather has its own timeout.
TRAINING_COLLECTIVES = ("comm", "collective", LOOP_COLLECTIVE)
_PHASE_OF_MARK = {
    Mark.STEP_START: "data",
    Mark.DATA_BEGIN: "data",
    Mark.DATA_END: "between data and forward",
    Mark.FORWARD_BEGIN: "forward",
    Mark.FORWARD_END: "between forward and backward",
    Mark.BACKWARD_BEGIN: "backward",
    Mark.GRAPH_DONE: "comm",
    Mark.BACKWARD_END: "between backward and optimizer",
    Mark.OPTIMIZER_BEGIN: "optimizer",
    Mark.OPTIMIZER_END: "after the optimizer step",
    Mark.PAUSE_BEGIN: "paused",
    Mark.PAUSE_END: "after a pause",
    Mark.STEP_END: "data",
    Mark.COMM_BEGIN: "collective",  # FSDP's all-gather or reduce-scatter inside forward or backward
    Mark.COMM_END: "forward or backward (between collectives)",
    Mark.LOOP_COMM_BEGIN: LOOP_COLLECTIVE,  # a barrier, a metric's all-reduce, the framework's broadcast
    Mark.LOOP_COMM_END: "after a collective of the loop's",
}


def beat_period(world_size: int, timeout_s: float | None) -> float:
    """Seconds between heartbeats: BEAT_S, longer on large jobs (world_size / STORE_BEATS_PER_S), never
    longer than hang_timeout / BEATS_PER_TIMEOUT."""
    period = max(BEAT_S, world_size / STORE_BEATS_PER_S)
    if timeout_s is not None:
        period = min(period, max(BEAT_S, timeout_s / BEATS_PER_TIMEOUT))
    return period


def classify_hang(
    beats: dict[int, dict[str, Any]],
    world_size: int,
    timeout_s: float,
    placement: Placement | None = None,
    collective_only: bool = False,
) -> Finding | None:
    """DIST.HANG from every rank's latest heartbeat, or None while any rank still progresses (or, with
    `collective_only`, the warm-up rule, unless some ranks wait in a training collective that others never
    reached).

    A heartbeat: {"step", "phase", "idle_s" (seconds without progress, as of publishing), "age_s" (how old
    the heartbeat is), "syncs"}, and inside FSDP's collectives "forwards" and "pass" (`StepRecorder.pass_now`).
    A rank without a heartbeat, or whose heartbeat went stale, is missing.
    With a `placement`, ranks are named with their host and local rank.
    """
    place = placement or Placement()
    idle = {}
    for r in range(world_size):
        b = beats.get(r)
        idle[r] = float("inf") if b is None else _idle(b)
        if b is not None and progressing(b, timeout_s):
            return None  # someone is still making progress: slow, not hung
    if len(beats) == world_size and all(
        b["phase"] == "paused" and float(b.get("age_s", 0.0)) < timeout_s for b in beats.values()
    ):
        return None  # every rank alive, in a pause it was told of (an evaluation, a checkpoint): not training
    phases = TRAINING_COLLECTIVES if collective_only else WAITING_PHASES
    waiting = sorted(r for r, b in beats.items() if b["phase"] in phases)
    missing = sorted(r for r in range(world_size) if r not in waiting)
    ahead = _forward_ahead(beats, waiting)
    if collective_only and not (waiting and missing) and not ahead:
        return None  # the warm-up rule: only ranks left waiting by others make a hang
    allreduce = _waited_in(beats, waiting)
    if waiting and missing:
        syncs = max(int(beats[r]["syncs"]) for r in waiting) + 1
        joined = all(beats[r]["phase"] == JOINED for r in waiting)  # (their step stopped as they ran out)
        at = (
            [r for r in missing if r in beats]
            if joined
            else [r for r in waiting if beats[r]["phase"] != JOINED]
        )
        at_step = max(_label(beats[r]) for r in at or waiting)  # (where a rank between steps may be)
        # Joined: the step of the ranks still training, which wait in nothing.
        step = at_step if joined else max(_waits_in(beats[r]) for r in at)
        waited = min(idle[r] for r in waiting)
        if allreduce == LOOP_WAIT and all(
            _working(beats.get(r), at_step, timeout_s, waited) for r in missing
        ):
            return _kept_waiting(beats, waiting, missing, step, timeout_s, idle, place)
        which = (
            allreduce
            if allreduce in (GATHER, LOOP_WAIT)
            else f"the {_ordinal(syncs)} {allreduce.removeprefix('the ')}"
        )
        title = (
            f"rank{'s' if len(missing) > 1 else ''} {format_ranks(missing)}{_on_hosts(missing, place)} never "
            f"reached {which}"
        )
        how = (
            "inside join(), out of batches, for"
            if joined
            else "in backward for"
            if allreduce == GRADIENT_ALLREDUCE  # (not a loop's collective, a metric's all-reduce among them)
            else "in"
        )
        detail = (
            f"At step {step}, rank{'s' if len(waiting) > 1 else ''} {format_ranks(waiting)} "
            f"{'have' if len(waiting) > 1 else 'has'} been waiting {how} {allreduce} for "
            f"{min(idle[r] for r in waiting):.0f} s; " + _whereabouts(missing, beats, place) + "."
        )
        ranks = missing
    elif waiting and (len({(beats[r]["phase"], int(beats[r]["syncs"])) for r in waiting}) > 1 or ahead):
        ranks = ahead or _in_another_collective(beats, waiting)
        step = min(_waits_in(beats[r]) for r in (waiting if ahead else ranks or waiting))
        title = (
            f"rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)}{_on_hosts(ranks, place)} "
            f"wait{'' if len(ranks) > 1 else 's'} in a collective the others are not in"
            if ranks
            else "the ranks wait in different collectives"
        )
        detail = (
            "Every rank waits in a collective, not all in the same one: "
            + _whereabouts(waiting, beats, place)
            + (
                f". Rank{'s' if len(ranks) > 1 else ''} {format_ranks(ranks)} ran a forward where the others "
                "ran a backward: a backward skipped on some ranks only (a data-dependent `continue` after the "
                "loss, a rank-dependent branch around `backward()`), or a forward in training mode run on them "
                "only, sets FSDP's collectives out of step: they pair up wrongly until one never does."
                if ahead
                else ". A collective called on some ranks only (under `if rank == 0` or `is_main_process`, in a "
                "loop over an evaluation loader longer on some ranks, past a `continue` some ranks take) leaves "
                "the ranks that called it waiting for the others, who went on to the next one."
            )
        )
    elif waiting:
        detail = (
            f"Every rank has waited in {allreduce} for {min(idle.values()):.0f} s: "
            "the collective itself is stuck (network, NCCL/gloo, a peer outside this job)."
        )
        title, ranks, step = (
            f"all ranks stuck inside {allreduce}",
            [],
            max(_waits_in(b) for b in beats.values()),
        )
    elif len({(_label(b), b["phase"]) for b in beats.values()}) == 1 and len(beats) == world_size:
        return _no_progress(beats, world_size, timeout_s, idle)  # one place: slow work, or an unseen wait
    else:
        behind = _behind(beats, world_size)
        everyone = list(range(world_size))
        detail = "No rank has progressed: " + _whereabouts(
            behind + [r for r in everyone if r not in behind], beats, place
        )
        detail += (
            f". Rank{'s' if len(behind) > 1 else ''} {format_ranks(behind)} {'are' if len(behind) > 1 else 'is'} "
            "furthest behind: the others most likely wait for it in a collective pytscope does not time "
            "(an asynchronous collective's wait outside `scope.collective()`, one inside torch's own code)"
            if behind
            else ""
        ) + "."
        title, ranks, step = (
            f"rank{'s' if len(behind) > 1 else ''} {format_ranks(behind)}{_on_hosts(behind, place)} "
            "stopped behind the others"
            if behind
            else "no rank is making progress",
            behind or everyone,
            max((_label(b) for b in beats.values()), default=1),
        )
    limit = (
        f"during warm-up: {timeout_s:.0f} s inside a collective"
        if collective_only
        else f"hang_timeout {timeout_s:.0f} s"
    )
    return Finding(
        code="DIST.HANG",
        severity=Severity.HIGH,
        title=title,
        detail=f"{detail} ({limit}; stacks of every live rank are in stacks/)",
        recommendation=(
            ("Read the named rank's stack first" if ranks else "Read every rank's stack in stacks/")
            + ": a blocked data loader, a rank that skipped a batch (uneven shards, a data-dependent `continue`),"
            " or a rank-dependent branch around backward or a collective."
        ),
        ranks=tuple(ranks),
        steps=(step,),
        evidence={f"idle_s_rank{r}": idle[r] for r in range(min(world_size, 16)) if idle[r] != float("inf")},
    )


_PHASE_ORDER = (
    "data",
    "between data and forward",
    "forward",
    "between forward and backward",
    "backward",
    "comm",
    "between backward and optimizer",
    "optimizer",
    "after the optimizer step",
)


def _behind(beats: dict[int, dict[str, Any]], world_size: int) -> list[int]:
    """The ranks furthest behind in the step (by step, then by phase in a step's order), where every rank
    beats and every phase has a place in that order; else none (positions that cannot be compared)."""
    if len(beats) != world_size or any(b["phase"] not in _PHASE_ORDER for b in beats.values()):
        return []
    where = {r: (_label(b), _PHASE_ORDER.index(b["phase"])) for r, b in beats.items()}
    last = min(where.values())
    return sorted(r for r, w in where.items() if w == last)


def _in_another_collective(beats: dict[int, dict[str, Any]], waiting: list[int]) -> list[int]:
    """Of ranks all waiting, not all in the same collective: those furthest behind (fewest gradient syncs,
    then the earliest step), unless that is all of them; then those in a collective of the loop's (DDP's
    all-reduce and pytscope's gather are called by every rank, so the odd one is the loop's); else none."""
    first = min((int(beats[r]["syncs"]), _label(beats[r])) for r in waiting)
    behind = [r for r in waiting if (int(beats[r]["syncs"]), _label(beats[r])) == first]
    if len(behind) < len(waiting):
        return behind
    loops = [r for r in waiting if beats[r]["phase"] == LOOP_COLLECTIVE]
    return loops if len(loops) < len(waiting) else []


def _forward_ahead(beats: dict[int, dict[str, Any]], waiting: list[int]) -> list[int]:
    """Of ranks all waiting inside FSDP's collectives, those a forward ahead of the others: past the forward
    whose backward the ranks furthest behind are in (a later forward of that step, or a later step). Every
    rank runs FSDP's collectives in the same order, so ranks that wait in them at different places diverged:
    those ahead ran a forward where the others ran a backward (one they skipped); the collectives then pair
    up wrongly (gloo matches a forward's all-gather with a backward's) until one never does. A forward's
    all-gather and a backward's reduce-scatter are one phase, `collective`, and a rank that skipped its
    backward (and so its optimizer step) has the same step and gradient-sync counts as the others: only the
    forwards begun and the pass tell them apart. Proof of a hang even in warm-up: a compile between one
    unit's collective marks leaves every rank at the same place."""
    if len(waiting) < 2 or any("pass" not in beats[r] for r in waiting):
        return []
    at = {r: (_label(beats[r]), int(beats[r].get("forwards", 0))) for r in waiting}
    first = min(at.values())
    behind = [r for r in waiting if at[r] == first]
    if any(beats[r]["pass"] != "backward" for r in behind):
        return []
    return sorted(r for r in waiting if at[r] > first)


def _no_progress(
    beats: dict[int, dict[str, Any]], world_size: int, timeout_s: float, idle: dict[int, float]
) -> Finding:
    """Every rank at one place, none in a collective pytscope times: all busy there (an evaluation or a
    checkpoint outside `paused()`, slow work) or all in a collective pytscope does not see that some rank
    never reached. Which, only the stacks tell: MED, and the watchdog does not end the job for it."""
    beat = next(iter(beats.values()))
    step, phase = _label(beat), beat["phase"]
    return Finding(
        code="DIST.HANG",
        severity=Severity.MED,
        title=f"no rank has progressed for {min(idle.values()):.0f} s",
        detail=(
            f"Every rank{'' if world_size > 1 else ' (the only one)'} has been at step {step} in `{phase}` for "
            f"{min(idle.values()):.0f} s: all busy there, or all waiting in a collective pytscope does not time "
            f"that some rank never reached. pytscope does not end the job for this (hang_timeout "
            f"{timeout_s:.0f} s; stacks of every rank are in stacks/)."
        ),
        recommendation=(
            "Read the stacks in stacks/: a rank whose stack is not inside a collective is the one the others "
            "wait for. If every rank is busy (evaluation or checkpointing in the loop), wrap that in "
            "`scope.paused()` or raise hang_timeout."
        ),
        steps=(step,),
        evidence={f"idle_s_rank{r}": idle[r] for r in range(min(world_size, 16))},
    )


BETWEEN_STEPS = ("after the optimizer step", "after a pause", "paused")
"""Where a rank may do work of its own while the others wait in a collective of the loop's (a sample, a
checkpoint on rank 0 only): between its optimizer step and the next batch."""


def _working(beat: dict[str, Any] | None, step: int, timeout_s: float, waited_s: float) -> bool:
    """A rank alive (its heartbeat fresh), between steps at the waiting ranks' step or past it, for less than
    PAUSE_FACTOR timeouts (as long as a paused rank gets): what it does there may be work of its own. A rank
    inside a step (its data, forward, backward) has provably not reached the collective the others wait in."""
    return (
        beat is not None
        and float(beat.get("age_s", 0.0)) < timeout_s
        and beat["phase"] in BETWEEN_STEPS
        and _label(beat) >= step
        and waited_s < PAUSE_FACTOR * timeout_s
    )


def _kept_waiting(
    beats: dict[int, dict[str, Any]],
    waiting: list[int],
    missing: list[int],
    step: int,
    timeout_s: float,
    idle: dict[int, float],
    place: Placement,
) -> Finding:
    """Some ranks wait in a collective of the loop's while the others, alive between steps, do something else:
    work of some ranks only between steps looks the same as a rank stuck there. MED, for up to PAUSE_FACTOR
    timeouts, then HIGH (a DDP all-reduce some rank never reached is proof: every rank does the same work
    before it)."""
    few = len(missing) > 1
    return Finding(
        code="DIST.HANG",
        severity=Severity.MED,
        title=f"rank{'s' if few else ''} {format_ranks(missing)}{_on_hosts(missing, place)} kept the others "
        f"waiting for {min(idle[r] for r in waiting):.0f} s",
        detail=(
            f"At step {step}, rank{'s' if len(waiting) > 1 else ''} {format_ranks(waiting)} "
            f"{'have' if len(waiting) > 1 else 'has'} been waiting in {LOOP_WAIT} for "
            f"{min(idle[r] for r in waiting):.0f} s; {_whereabouts(missing, beats, place)}: work of some ranks "
            "only between steps (a sample, a checkpoint, an evaluation outside `scope.paused()`) looks the same "
            f"as a rank stuck there. It becomes a HIGH hang at {PAUSE_FACTOR * timeout_s:.0f} s "
            f"({PAUSE_FACTOR:.0f}x hang_timeout, as for a paused rank; stacks of every rank are in stacks/)."
        ),
        recommendation=(
            f"Read rank {missing[0]}'s stack in stacks/: if it is working, wrap that work in `scope.paused()` "
            "(or raise hang_timeout); if it is stuck, its stack says where."
        ),
        ranks=tuple(missing),
        steps=(step,),
        evidence={f"idle_s_rank{r}": idle[r] for r in range(min(len(idle), 16)) if idle[r] != float("inf")},
    )


LEFT_BEHIND_S = 2.0
"""At this process's exit without finish(): another rank inside a collective of training this long (two beats on
small jobs) is waiting for this one, which is leaving the job mid-training."""


def left_waiting(store: Any, prefix: str, rank: int, world_size: int) -> tuple[int, str] | None:
    """Another rank (and its phase) that its heartbeat shows waiting in a collective of training for at least
    LEFT_BEHIND_S: at this rank's exit, it waits for this rank and will not come to finish()."""
    keys = [f"{prefix}/hb/{r}" for r in range(world_size)]
    now = _wall()
    for r, raw in sorted(read_beats(store, keys).items()):
        beat = json.loads(raw)
        waited = float(beat["idle_s"]) + max(0.0, now - float(beat["t"]))
        if r != rank and beat["phase"] in TRAINING_COLLECTIVES and waited >= LEFT_BEHIND_S:
            return r, str(beat["phase"])
    return None


def _idle(beat: dict[str, Any]) -> float:
    return float(beat["idle_s"]) + float(beat.get("age_s", 0.0))


def progressing(beat: dict[str, Any], timeout_s: float) -> bool:
    """Whether the rank of this heartbeat progressed within the timeout (a paused rank gets PAUSE_FACTOR
    timeouts)."""
    return _idle(beat) < timeout_s * (PAUSE_FACTOR if beat["phase"] == "paused" else 1.0)


WHEREABOUTS_LISTED = 8  # ranks whose whereabouts a hang finding spells out; the rest are counted


def _whereabouts(ranks: list[int], beats: dict[int, dict[str, Any]], place: Placement) -> str:
    """Where each of `ranks` is ("rank 3 on host h01, local rank 3 is at step 30 in `data` for 12 s"), the
    first few only, and which whole hosts they make up."""
    listed = "; ".join(f"{place.describe(r)} {_where(beats.get(r))}" for r in ranks[:WHEREABOUTS_LISTED])
    if len(ranks) > WHEREABOUTS_LISTED:
        listed += f"; and {len(ranks) - WHEREABOUTS_LISTED} more"
    whole = place.whole_hosts(ranks)
    if whole:
        listed += f" (every rank of host{'s' if len(whole) > 1 else ''} {', '.join(whole)})"
    return listed


def _on_hosts(ranks: list[int], place: Placement) -> str:
    hosts = {place.host(r) for r in ranks}
    return f" on host {hosts.pop()}" if len(hosts) == 1 and None not in hosts else ""


GATHER = "pytscope's gather of step records (between steps)"
GRADIENT_ALLREDUCE = "the gradient all-reduce"
LOOP_WAIT = (
    "a collective the training loop calls (a barrier, a metric's all-reduce, the framework's broadcast)"
)


def _waited_in(beats: dict[int, dict[str, Any]], waiting: list[int]) -> str:
    """The collective the waiting ranks are in: one the loop calls itself (`collectives.py`), DDP's gradient
    all-reduce, FSDP's collectives (inside forward and backward, so "in backward" would be wrong), or, when
    every one of them is there, the scope's own gather of records at a step boundary."""
    phases = {beats[r]["phase"] for r in waiting}
    if LOOP_COLLECTIVE in phases:
        return LOOP_WAIT
    if "collective" in phases:
        # A heartbeat's "collective" is a forward's all-gather or a backward's all-gather or reduce-scatter
        # alike; the ordinal put before it counts gradient syncs, so it names the round that ends in one.
        return "the FSDP all-gather and reduce-scatter round"
    if phases == {"gather"}:
        return GATHER
    return GRADIENT_ALLREDUCE


def _ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th ... 11th, 12th, 13th, 21st: a count, so that it is not read as a step number."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _where(beat: dict[str, Any] | None) -> str:
    if beat is None:  # never beat: a Python thread cannot while native code holds the GIL
        return "sent no heartbeat (dead, not started, or stuck in native code that holds the GIL)"
    within = ""
    if beat.get("pass"):  # inside FSDP's collectives: which forward of the step, or its backward
        nth = _ordinal(int(beat.get("forwards", 0)))
        within = (
            f", in its {nth} forward," if beat["pass"] == "forward" else f", in its {nth} forward's backward,"
        )
    return f"is at step {_label(beat)} in `{beat['phase']}`{within} for {float(beat['idle_s']):.0f} s"


def position(recorder: StepRecorder) -> str | None:
    """Where the training thread is, from the recorder alone ("at step 30 in `forward`"): what a SIGTERM
    interrupted where no watchdog runs (hang_timeout=None). None before the first step. Reads only."""
    (steps, _, _), last = recorder.progress()
    if last is None:
        return None
    return f"at step {steps + recorder.step_origin} in `{_PHASE_OF_MARK.get(Mark(last), 'other')}`"


def _label(beat: dict[str, Any]) -> int:
    """The step a rank is in, numbered as its framework numbers steps (beats carry steps done and the
    number of the first step)."""
    return int(beat["step"]) + int(beat.get("origin", 1))


def _waits_in(beat: dict[str, Any]) -> int:
    """The step a rank waiting in a collective waits in, as its records number steps: its own, or, where its
    optimizer has stepped (a collective the loop calls after `optimizer.step()`; Lightning's broadcast at the
    top of the next batch, which comes before the fetch that ends the step), the next one. A hang writes such
    a step as done: named by it, every rank's records reaching it would read as a run gone on past the hang
    (`rules._gone_past`), a hang that ended the job as a stall."""
    return _label(beat) + int(bool(beat.get("stepped", False)))


def dump_stacks(path: Path, rank: int) -> Path:
    """Every thread's Python stack, readable, into `path/stacks/rank{rank}.txt`."""
    out = path / "stacks" / f"rank{rank}.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = [f"pytscope stack dump, rank {rank}, pid {os.getpid()}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n"]
    for ident, frame in sys._current_frames().items():
        parts.append(f"\nThread {names.get(ident, '?')} ({ident}):\n")
        parts.extend(traceback.format_stack(frame))
    out.write_text("".join(parts))
    return out


class Watchdog(threading.Thread):
    """One per rank; a daemon thread that never touches the training's tensors or collectives.

    On a hang the order is fixed so that nothing can stop the abort once decided: rank 0 raises the flag in
    the store first, then reports; every rank then writes its own ungathered rows (`flush`), dumps its
    stacks and, with on_hang="abort", exits. Each of those steps is attempted on its own; a failing one is
    said on stderr and the next still runs.
    """

    def __init__(
        self,
        recorder: StepRecorder,
        store: Any,
        rank: int,
        world_size: int,
        run_dir: Path,
        timeout_s: Callable[[], float | None],
        on_hang: str,
        report: Callable[[Finding], None],
        prefix: str = "pytscope",
        disabled_key: str | None = None,
        flush: Callable[[str], None] | None = None,
        placement: Placement | None = None,
        warmup_timeout_s: Callable[[], float | None] | None = None,
    ) -> None:
        super().__init__(name="pytscope-watchdog", daemon=True)
        self.recorder = recorder
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.run_dir = run_dir
        self.timeout_s = timeout_s  # None: no hang detection now...
        self.warmup_timeout_s = warmup_timeout_s  # ...unless this gives one, for collective waits only
        self.on_hang = on_hang
        self.report = report
        self.prefix = prefix
        self.disabled_key = disabled_key  # set in the store by a rank whose scope was disabled
        self.flush = flush  # writes this rank's ungathered rows into the run directory
        self.placement = placement  # rank 0: every rank's host and local rank, named in DIST.HANG
        self._present: set[int] = set()  # ranks whose heartbeat key exists (keys are never deleted)
        self.stopped = threading.Event()
        self.status = ""  # "gather", "finished" ... set by the scope around its own waits
        self._seen: tuple[int, int, int] = (-1, -1, -1)
        self._progress_t = _monotonic()
        self._local_beat: dict[str, Any] = {}
        self._step_seen = (recorder.steps_done, _monotonic())
        self.slowest_step_s = 0.0  # the slowest step past warm-up ("auto" scales with it): see `step_walls`
        self._walls_known = False
        # Rank 0: the severity of the hang reported, while no rank has progressed since (a MED one that
        # becomes provable is reported again, as HIGH).
        self._reported: Severity | None = None
        self._hangs = 0  # rank 0: hangs reported (the flag's count)
        self._flag_seen = ""  # other ranks: the last flag acted on

    def stop(self, wait_s: float = STOP_WAIT_S) -> None:
        """Stop and wait for the thread, so it is never inside a store call when the process exits: a daemon
        thread that the interpreter ends in the middle of C++ code aborts the process ("terminate called
        without an active exception")."""
        self.stopped.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(wait_s)

    def whereabouts(self) -> str | None:
        """Where this rank was at its last heartbeat, when it had been there a second or more ("at step 30
        in `forward` for 15 s"): what a SIGTERM interrupted. None before the first beat, while progressing, or
        on any error (it is said on the way out: the rows must be written regardless)."""
        try:
            beat = dict(self._local_beat)
            beat["idle_s"] = float(beat["idle_s"]) + max(0.0, _wall() - float(beat["t"]))
            return _where(beat).removeprefix("is ") if beat["idle_s"] >= 1.0 else None
        except Exception:  # (no beat yet: KeyError)
            return None

    def step_walls(self, walls_ms: Any) -> None:
        """Wall ms of steps past warm-up, as the scope drains them at a gather (pauses left out). Until the first,
        the slowest step is the longest gap between two step closes this thread saw, which a validation in it,
        or a warm-up step's compilation, lengthens: enough to put off a hang by hours."""
        if len(walls_ms):
            slowest = float(max(walls_ms)) / 1e3
            self.slowest_step_s = max(self.slowest_step_s, slowest) if self._walls_known else slowest
            self._walls_known = True

    def period(self) -> float:
        """Seconds until the next beat (and, on rank 0, the next check): see `beat_period`."""
        try:
            timeout = self._timeout()[0]
        except Exception:  # "auto" reads the recorder: never let that stop the heartbeat
            timeout = None
        return beat_period(self.world_size, timeout)

    def _timeout(self) -> tuple[float | None, bool]:
        """The timeout in force, and whether only ranks waiting in a collective count (the warm-up rule)."""
        timeout = self.timeout_s()
        if timeout is None and self.warmup_timeout_s is not None:
            return self.warmup_timeout_s(), True
        return timeout, False

    def run(self) -> None:
        while not self.stopped.wait(self.period()):
            try:
                self._beat()
                abort = self._hang_flag()  # None: no new hang raised by rank 0
                if self.rank == 0:
                    if self._peer_disabled():  # its beats stop: judging it would call a hang
                        return
                    abort = self._judge()
            except STORE_ERRORS as exc:  # the store went away (job ending): stop quietly, never hurt training
                if not self.stopped.is_set():
                    say(self.rank, f"watchdog stopped: {type(exc).__name__}: {exc}")
                return
            except Exception as exc:  # its own error: one line, not a thread's traceback; training goes on
                say(
                    self.rank,
                    f"watchdog stopped by an internal error, hangs go unseen: {type(exc).__name__}: {exc}",
                )
                return
            if abort is not None:
                self._on_hang(abort)  # (returns only when the job goes on: watching goes on too)

    def _judge(self) -> bool | None:
        """Rank 0: report a hang once (until some rank progresses again) and tell every rank whether to end
        the job: only with on_hang="abort", and only for a hang proven by positions (HIGH), never for every
        rank idle at one place (MED: slow work looks the same). None: nothing new."""
        finding = self._check()
        if finding is None:
            self._reported = None  # progress: the next hang is reported again
            return None
        if self._reported is not None and finding.severity <= self._reported:
            return None
        self._reported = finding.severity
        abort = self.on_hang == "abort" and finding.severity is Severity.HIGH
        self._raise_flag(abort)
        self._attempt("report the hang", self.report, finding)
        return abort

    def _attempt(self, what: str, fn: Callable[..., Any], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # one failing step of the hang path must not cancel the others
            say(self.rank, f"could not {what}: {type(exc).__name__}: {exc}")

    def _beat(self) -> None:
        rec = self.recorder
        signature, last_mark = rec.progress()
        now = _monotonic()
        if signature != self._seen:
            self._seen = signature
            self._progress_t = now
        steps_done = signature[0]
        if steps_done != self._step_seen[0] and not self._walls_known:
            self.slowest_step_s = max(
                self.slowest_step_s, (now - self._step_seen[1]) / (steps_done - self._step_seen[0])
            )
            self._step_seen = (steps_done, now)
        phase = self.status or (
            _PHASE_OF_MARK.get(Mark(last_mark), "other") if last_mark is not None else "data"
        )
        self._local_beat = {
            "step": rec.steps_done,  # closed steps: a rank after its optimizer step is still in that step
            "origin": rec.step_origin,
            # A hang writes the open step as done once its optimizer stepped (not an open iteration, none
            # watched): what this rank waits in then is the next step's (`_waits_in`).
            "stepped": not rec.iteration_steps and rec.completed[0] > rec.steps_done,
            "phase": phase,
            "idle_s": round(now - self._progress_t, 3),
            "syncs": rec.grad_syncs,
            "t": _wall(),
        }
        if phase == "collective":  # FSDP's: a forward's all-gather or a backward's (`_forward_ahead`)
            self._local_beat["forwards"], self._local_beat["pass"] = rec.pass_now()
        if self.store is not None:
            self.store.set(f"{self.prefix}/hb/{self.rank}", json.dumps(self._local_beat))

    def _check(self) -> Finding | None:
        timeout, collective_only = self._timeout()
        if timeout is None:
            return None
        beats: dict[int, dict[str, Any]] = {0: {**self._local_beat, "age_s": 0.0}}
        if progressing(beats[0], timeout):
            return None  # rank 0 itself progresses, so no hang: nothing to read from the store
        if self.store is not None:
            now = _wall()
            keys = [f"{self.prefix}/hb/{r}" for r in range(1, self.world_size)]
            for r, raw in read_beats(self.store, keys, self._present).items():
                b = json.loads(raw)
                b["age_s"] = max(0.0, now - float(b["t"]))
                beats[r + 1] = b
        return classify_hang(beats, self.world_size, timeout, self.placement, collective_only)

    def _peer_disabled(self) -> bool:
        return (
            self.store is not None and self.disabled_key is not None and self.store.check([self.disabled_key])
        )

    def _hang_flag(self) -> bool | None:
        """Other ranks: whether to end the job, when rank 0 raised a hang flag this rank has not acted on."""
        key = f"{self.prefix}/hang"
        if self.store is None or self.rank == 0 or not self.store.check([key]):
            return None
        flag = self.store.get(key).decode()  # "<count>:abort" or "<count>:report"
        if flag == self._flag_seen:
            return None
        self._flag_seen = flag
        return flag.endswith(":abort")

    def _raise_flag(self, abort: bool) -> None:
        self._hangs += 1
        if self.store is not None:
            flag = f"{self._hangs}:{'abort' if abort else 'report'}"
            self._attempt("raise the hang flag", self.store.set, f"{self.prefix}/hang", flag)

    def _on_hang(self, abort: bool) -> None:
        if self.flush is not None:
            self._attempt("write this rank's steps", self.flush, "hang")
        self._attempt("dump the stacks", dump_stacks, self.run_dir, self.rank)
        if self.store is not None:
            self._attempt(
                "tell rank 0 the stacks are dumped", self.store.set, self._dumped_key(self.rank), "1"
            )
        if not abort:
            return
        # Rank 0 ends first, once every rank's stacks are dumped, then the others: a rank that ended while rank
        # 0 waited in a collective for it made rank 0's training thread raise first (a traceback, a lost
        # connection), and a launcher then ended rank 0 with SIGTERM, not the hang's exit code.
        if self.rank == 0 and self.store is not None:
            self._attempt("wait for the other ranks' stacks", self._wait_for_dumps)
            self._attempt("tell the other ranks to end", self.store.set, f"{self.prefix}/ended", "1")
        elif self.store is not None:
            self._attempt("wait for rank 0 to end", self._wait_for, [f"{self.prefix}/ended"], END_WAIT_S)
        say_last(self.rank, abort_line(self.rank, local_place()[1]))
        sys.stdout.flush()
        os._exit(HANG_EXIT_CODE)

    def _wait_for_dumps(self) -> None:
        self._wait_for([self._dumped_key(r) for r in range(self.world_size)], DUMP_WAIT_S)

    def _dumped_key(self, rank: int) -> str:
        """The key by which `rank` says it dumped its stacks for the hang flag acted on (by the flag's count):
        those of an earlier report that did not end the job (MED, a rank kept the others waiting) must not
        count for a later abort, or rank 0 ends before the others saw it, and a rank busy outside any
        collective, its store gone with rank 0, is left running."""
        count = str(self._hangs) if self.rank == 0 else self._flag_seen.partition(":")[0]
        return f"{self.prefix}/dumped/{count}/{rank}"

    def _wait_for(self, keys: list[str], wait_s: float) -> None:
        deadline = _monotonic() + wait_s
        poll = max(0.05, self.world_size / STORE_BEATS_PER_S)  # every rank polls: the store's rate, as beats
        while _monotonic() < deadline and not self.store.check(keys):
            time.sleep(poll)


def abort_line(rank: int, local_rank: int) -> str | None:
    """What a rank says as a hang's abort ends it: one line per host, not one per rank (rank 0's, and on each
    other host its local rank 0's, for that host's own log; every rank's where the launcher sets no
    LOCAL_RANK); None for the other ranks."""
    if rank != 0 and local_rank > 0:  # (a rank that does not know its local rank speaks: its host may not)
        return None
    return f"hang detected: every rank exits with code {HANG_EXIT_CODE} (on_hang='abort')"


def read_beats(store: Any, keys: list[str], present: set[int] | None = None) -> dict[int, bytes]:
    """The heartbeats present under `keys`, by index. Keys in `present` (indices seen before: heartbeats are
    never deleted) are read in one `multi_get` without a check; the others in one check and one `multi_get`
    when all of them are there, else one check and one get each. `present` is updated."""
    present = set() if present is None else present
    batched = hasattr(store, "multi_get")
    seen = sorted(present)
    out: dict[int, bytes] = {}
    if seen:
        values = store.multi_get([keys[i] for i in seen]) if batched else [store.get(keys[i]) for i in seen]
        out.update(zip(seen, values, strict=True))
    rest = [i for i in range(len(keys)) if i not in present]
    if rest and batched and store.check([keys[i] for i in rest]):
        out.update(zip(rest, store.multi_get([keys[i] for i in rest]), strict=True))
    elif rest:
        out.update({i: store.get(keys[i]) for i in rest if store.check([keys[i]])})
    present.update(out)
    return out
