"""What analysis knows about a run besides its step records: settings, segments, and cross-rank checks.

Rank 0 collects these at every gather (and the run directory stores them as JSON lines); analysis takes
them as plain frozen dataclasses so that the rules stay pure functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .placement import Placement


@dataclass(frozen=True)
class Segment:
    """One launch of the job. A resume from a checkpoint starts a new segment."""

    index: int
    started_s: float  # seconds since the epoch
    resumed_from_step: int  # last step already done when this segment started (0 for a fresh run)
    world_size: int


@dataclass(frozen=True)
class CountsCheck:
    """Each rank's cumulative counters at one gather, compared before any records are exchanged."""

    gather: int  # gather number, 1-based
    steps: tuple[int, ...]  # per rank: optimizer steps done
    grad_syncs: tuple[int, ...]  # per rank: gradient synchronisations done
    micro_batches: tuple[int, ...]  # per rank: forward passes done
    joined: tuple[int, ...] = ()  # ranks out of batches inside torch's Join at this gather

    COUNTERS = ("steps", "grad_syncs", "micro_batches")

    def compared(self, counter: str) -> tuple[float, ...]:
        """Each rank's `counter` as the ranks' counts are compared: NaN for a rank inside a join, whose steps
        and micro-batches stop there while the others train (its gradient syncs go on: it shadows them)."""
        skip = () if counter == "grad_syncs" else self.joined
        return tuple(math.nan if r in skip else float(v) for r, v in enumerate(getattr(self, counter)))

    @property
    def differs(self) -> bool:
        """Whether the ranks compared disagree on some counter."""
        return any(len({v for v in self.compared(c) if v == v}) > 1 for c in self.COUNTERS)


@dataclass(frozen=True)
class ReplicaCheck:
    """Each rank's parameter checksum at one gather (data-parallel replicas must agree)."""

    step: int
    checksums: tuple[float, ...]  # per rank; NaN where a rank could not compute one


RAISED = " raised "
"""In the reason a rank wrote its own rows with, when an exception ended it ("the fit raised ...")."""
DIED = " died of "
"""...and when a fatal signal ended it ("the process died of SIGABRT in all_reduce, called from train.py line
91"), read from the dump faulthandler wrote for it (`signals.ProcessEnds`): no Python of the rank ran then."""
LEFT = " left the job "
"""...and when it ended without finish() while another rank waited for it ("the process left the job ...")."""
STOPPED = "stopped without a final gather: "
"""Rank 0's scope note when its training ended it before the last gather, followed by its reason (the one its
own rows were written with); the report puts the run's first failure there where another rank's came first."""
NOT_FAILURES = ("KeyboardInterrupt", "SystemExit")
"""Exceptions after RAISED that end a rank without failing it: a user's Ctrl-C, a script's exit."""
FINISH_WITHOUT_ALL = "finish without every rank"
"""A rank's reason when it finished and the others never came to the last gather."""
FINISH_AFTER_TEARDOWN = "finish() after the process group was destroyed"
FIT_ENDED_EARLY = "the fit ended before its training did"
"""Lightning: a rank's fit ended (its teardown ran) before its training loop reached its end."""
PEER_GONE = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "remote process exited or there was a network error",
    "NCCL communicator was aborted",
)
"""What a collective raises when another process of the job has died or left: the error of a rank that lost
its peer, not a failure of its own. Gloo's socket errors; NCCL's `ncclRemoteError` ("remote process exited or
there was a network error"), and the abort its watchdog makes of the communicator after a peer's loss or a
collective's timeout ("NCCL communicator was aborted on rank N"): both follow from another rank, as a
lost connection does (a hang is named by pytscope's own watchdog, not by this error)."""


def lost_a_peer(reason: str) -> bool:
    """Whether a rank's error is a collective's lost connection to another rank that had gone."""
    return any(text in reason for text in PEER_GONE)


def ended_alone(reason: str) -> bool:
    """Whether a rank's own reason says that its process ended without the other ranks, with no failure of
    its own: it finished or exited first (out of batches, an early stop one rank decided), or a SIGTERM
    reached it. The other ranks' collectives then lose their connection to it."""
    exited = RAISED in reason and reason.split(RAISED, 1)[1].startswith(NOT_FAILURES)
    return exited or reason.startswith(
        ("SIGTERM", FINISH_WITHOUT_ALL, FINISH_AFTER_TEARDOWN, FIT_ENDED_EARLY)
    )


@dataclass(frozen=True)
class RankFailure:
    """A rank that an exception ended (what it wrote with its own rows)."""

    rank: int
    reason: str  # "the process raised RuntimeError: ..."
    last_step: int | None  # its last recorded step
    t: float | None  # seconds since the epoch, when it wrote them (None: a run from before they were kept)
    resumed_past: bool  # the job went on past it (a later launch recorded steps)
    segment: int | None = None  # its launch (None: a run from before launches were written with it)


SCOPE_DISABLED = "scope disabled"
"""In the message of an error after which a rank's scope recorded nothing more (`Scope.fail`)."""


@dataclass(frozen=True)
class RunContext:
    world_size: int
    interval: int = 50
    warmup: int = 5
    device: str = "cpu"  # e.g. "cpu", "NVIDIA H100 80GB HBM3"
    flops_per_step: float | None = None  # model FLOPs of one optimizer step on one rank
    peak_flops: float | None = None  # per-device peak FLOP/s
    step_origin: int = 1  # the number the framework gives its first step (Lightning: 0)
    precision: str | None = None  # what the matmuls train at: "bf16" (bf16/fp16 or autocast), "tf32", "fp32"
    mem_limit_bytes: float | None = None  # device memory (CUDA) or host RAM (CPU)
    parallelism: str | None = None  # what the model was wrapped in (parallelism.py); None: not recorded
    integration: str | None = (
        None  # "torch", "lightning", "accelerate" (the advice differs); None: not recorded
    )
    comm_measured: bool = True  # False: waits hide in compute, so no local work or straggler analysis
    segments: tuple[Segment, ...] = ()
    counts_checks: tuple[CountsCheck, ...] = ()
    joins: tuple[tuple[int, int], ...] = ()  # (rank, its last step) for each rank that ran out of batches
    # first and waited inside torch's Join while the others trained on (joins.py)
    replica_checks: tuple[ReplicaCheck, ...] = ()
    hang_reports: tuple[dict, ...] = ()  # DIST.HANG reports written by the watchdog (plain JSON)
    alive: tuple[
        tuple[int, float], ...
    ] = ()  # (segment, epoch s) the job was seen alive, stuck: its hang reports
    scope_errors: tuple[str, ...] = ()  # what went wrong in the scope (those with SCOPE_DISABLED: it stopped)
    # What rank 0's scope could not measure, or why it ended early (a fit raised).
    scope_notes: tuple[str, ...] = ()
    ended: bool = (
        True  # the run wrote its end-of-run summary; False: killed (SIGKILL, OOM, a hang's abort) or running
    )
    records_lost: bool = False  # the reader dropped torn or corrupt rows: a missing step may be one of them
    rank_notes: tuple[tuple[int, str], ...] = ()  # (rank, why it wrote its own rows: "hang", "SIGTERM" ...)
    failures: tuple[RankFailure, ...] = ()  # ranks ended by an exception, in every launch, first first
    placement: Placement = field(default_factory=Placement)  # each rank's host and local rank (meta "hosts")
    # (step, ranks) of the run's first NaN/Inf loss when it may lie before the steps analysed (the live
    # diagnosis's window of recent steps); None: judged from the steps themselves
    first_nonfinite: tuple[int, tuple[int, ...]] | None = None

    @property
    def scope_disabled(self) -> bool:
        """Some rank's scope disabled itself (an internal error): its records end there."""
        return any(SCOPE_DISABLED in e for e in self.scope_errors)

    @classmethod
    def from_meta(cls, meta: dict[str, Any], **fields: Any) -> RunContext:
        """The context of a run from its `meta.json` (settings, device, limits, FLOPs) plus what was learnt
        while it ran (`fields`: segments, checks, hang reports, errors). Live and final analysis both build
        their context here, so they judge a run by the same facts."""
        settings = {
            "world_size": int(meta.get("world_size") or 1),
            "interval": int(meta.get("interval", 50)),
            "warmup": int(meta.get("warmup", 5)),
            "device": str(meta.get("device", "cpu")),
            "flops_per_step": _positive(meta.get("flops_per_step")),
            "peak_flops": _positive(meta.get("peak_flops")),
            "step_origin": int(meta.get("step_origin", 1)),
            "precision": meta.get("precision") if isinstance(meta.get("precision"), str) else None,
            "mem_limit_bytes": _positive(meta.get("mem_limit_bytes")),
            "parallelism": meta.get("parallelism"),
            "integration": meta.get("integration") if isinstance(meta.get("integration"), str) else None,
            "comm_measured": meta.get("comm_measured") is not False,  # runs from before the key: measured
            "placement": Placement.from_meta(meta),
        }
        return cls(**{**settings, **fields})


def _positive(value: Any) -> float | None:
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return v if math.isfinite(v) and v > 0 else None
