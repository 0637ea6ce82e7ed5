"""The collective side of a run, the same on every rank: who this rank is, when the ranks meet, the exchange.

Gathers are triggered by the count of completed gradient all-reduces, which DDP keeps equal on every rank,
so a rank that took an extra or a missing optimizer step still meets the others at the same collective;
its differing step count is then reported (`DIST.DESYNC`) instead of deadlocking the job. Without DDP (or
when no sync is seen) the key is the optimizer step count. Every collective runs on the scope's own gloo
group with a timeout (`gather.Gatherer`); what the store is used for (the meeting at finish, the flag a
disabled rank raises) has a deadline too. Nothing here analyses or writes the run.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .gather import Exchange, header_row, syncs_per_step
from .placement import Placement, local_place
from .recorder import StepRecorder
from .rundir import claim_run_dir, next_segment

STORE_PREFIX = "pytscope"
RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun for its workers: which launch of the job this is
FINISH_WAIT_S = 30.0  # how long finish() waits for every rank to arrive before reporting without them
FINISH_POLL_S = 0.2
_ALL, _GAVE_UP = b"all", b"gave up"  # the outcomes of the meeting at finish


def store_prefix(segment: int, run: int = 0) -> str:
    """The scope's keys in the job's store, for this launch, run and segment: torchrun's store outlives a
    restart of its workers, and a restarted launch must not read the last one's hang flag or disabled mark;
    nor may a second run in one process group (another `fit()`, a sweep) read the first one's meeting at
    finish. `run`: `next_run_number()`, taken by rank 0."""
    return f"{STORE_PREFIX}/{os.environ.get(RESTART_ENV, '0')}/{run}/{segment}"


def next_run_number() -> int:
    """A number no other scope of this job has had (a counter in the job's store), 0 without one."""
    store = default_store()
    return int(store.add(f"{STORE_PREFIX}/runs", 1)) if store is not None else 0


class PeerDisabled(RuntimeError):
    """Another rank disabled its scope: gathering would wait for a rank that no longer comes."""


class RanksNotMet(RuntimeError):
    """The other ranks did not start a scope within `gather_timeout`: one was made on some processes only."""


class Coordinator:
    """Rank and world, the scope's process group, the gather schedule, and the meeting at finish."""

    def __init__(self, recorder: StepRecorder, interval: int, gather_timeout: float) -> None:
        self.recorder = recorder
        self.interval = interval
        self.gather_timeout = gather_timeout
        self.rank = 0
        self.world_size = 1
        self.gatherer: Any = None  # gather.Gatherer when distributed, until finish
        self.placement = Placement()  # every rank's host and local rank: rank 0 only (learnt at start)
        self.gathers = 0
        self.met_at_finish = False  # the final gather had every rank: a last barrier cannot wait for the dead
        self.skipped_at_finish = False  # some rank's open step at finish logged a non-finite loss
        self._next_gather = interval
        self.scheduled = False  # the first step boundary (or the first after a resume) has decided the key
        self._syncs_per_step = 1  # as rank 0 last told every rank (`gather.syncs_per_step`)
        # The scope's keys in the job's store: per launch and segment, from the start.
        self.store_prefix = STORE_PREFIX

    # -- start ----------------------------------------------------------------------------------------
    def start(self, run_dir: Path | None, segment: int = 0) -> tuple[Path, int]:
        """Learn rank and world size, create the scope's group (collective), agree on rank 0's run directory
        and segment (returned; `place_run`) and tell rank 0 where every rank runs."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
        # (A rank's own loss decides it in a one-rank run; with no optimizer watched, any iteration's work.)
        self.recorder.ends_unstepped = self.world_size == 1 or self.recorder.iteration_steps
        if self.world_size > 1:
            from .gather import Gatherer

            try:  # the scope's first collectives: every rank meets here, or, with a scope on some only, none
                self.gatherer = Gatherer(self.gather_timeout, capacity=self.interval)
                chosen = (*place_run(run_dir, segment), next_run_number()) if self.rank == 0 else None
                path, segment, run = self.gatherer.broadcast_object(chosen)
            except Exception as exc:
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    raise
                raise RanksNotMet(
                    f"the other ranks did not start a scope within gather_timeout ({self.gather_timeout:.0f} s): "
                    "create it on every process, at a point every process reaches"
                ) from exc
            self.store_prefix = store_prefix(segment, run)
            places = self.gatherer.gather_places(*local_place())
            if places is not None:
                self.placement = Placement.of(places)
            return path, segment
        self.placement = Placement.of([local_place()])
        return place_run(run_dir, segment)

    @property
    def distributed(self) -> bool:
        return self.gatherer is not None

    @property
    def syncs_per_step(self) -> int:
        """Gradient syncs per optimizer step, as rank 0 last told every rank (1 before the first gather)."""
        return self._syncs_per_step

    # -- when to gather -------------------------------------------------------------------------------
    def schedule(self, syncs_seen: bool) -> None:
        """At the first step boundary: meet on gradient syncs where DDP syncs (a safe place to meet even
        for a rank that took one optimizer step more or less), else on optimizer steps."""
        self.recorder.notify_on_syncs = syncs_seen and self.recorder.grad_syncs > 0
        self.scheduled = True
        self._advance()

    def due(self) -> bool:
        """Whether this step boundary is a gather point; moves the schedule on when it is."""
        if self._key() < self._next_gather:
            return False
        self._advance()
        return True

    def restart_schedule(self) -> None:
        """After a resume: the next step boundary decides again."""
        self.recorder.notify_at = 0
        self.scheduled = False

    def _key(self) -> int:
        rec = self.recorder
        return rec.grad_syncs if rec.notify_on_syncs else rec.steps_done

    def _advance(self) -> None:
        # `interval` counts optimizer steps: where each step syncs several times (accumulation without
        # no_sync()), the gathers after the first meet every `interval` steps' syncs (rank 0's count at the
        # last gather, the same on every rank: `gather.syncs_per_step`).
        span = self.interval * (self._syncs_per_step if self.recorder.notify_on_syncs else 1)
        self._next_gather = (self._key() // span + 1) * span
        self.recorder.notify_at = self._next_gather

    # -- the exchange ---------------------------------------------------------------------------------
    def exchange(self, counters: tuple[float, ...], rows: np.ndarray) -> Exchange | None:
        """Every rank's counters and rows on rank 0, None on the others (collective when distributed)."""
        self.gathers += 1
        ex: Exchange | None
        if self.gatherer is None:
            headers = header_row(counters, rows.shape[0])[None]
            ex, told = Exchange(headers, rows), syncs_per_step(headers)
        else:
            self.check_peers_enabled()
            ex = self.gatherer.exchange(counters, rows)
            told = self.gatherer.syncs_per_step
        if told != self._syncs_per_step:  # every rank is told the same at the same gather: the same schedule
            self._syncs_per_step = told
            self._advance()
        return ex

    def all_gather_ints(self, values: list[int]) -> list[list[int]] | None:
        return self.gatherer.all_gather_ints(values) if self.gatherer is not None else None

    # -- the store ------------------------------------------------------------------------------------
    def announce_disabled(self) -> None:
        """Tell the other ranks (their next gather and rank 0's watchdog) that this rank's scope is off."""
        store = default_store() if self.world_size > 1 else None
        if store is not None:
            try:
                store.set(self.disabled_key, str(self.rank))
            except STORE_ERRORS:
                pass

    def check_peers_enabled(self) -> None:
        store = default_store()
        if store is not None and store.check([self.disabled_key]):
            raise PeerDisabled(f"rank {store.get(self.disabled_key).decode()} disabled its scope")

    @property
    def disabled_key(self) -> str:
        """Set in the store by a rank whose scope was disabled (this launch and segment)."""
        return f"{self.store_prefix}/disabled"

    def all_ranks_arrive(
        self, give_up: Callable[[], str | None] | None = None, skipped: bool = False
    ) -> str | None:
        """Meet at the store first, so a rank that died or never finishes cannot hang the final gather. None
        when every rank arrived (the final gather may run); else why not, and this rank must not gather.
        `skipped`: this rank's open step logged a NaN or Inf loss; `skipped_at_finish` says, once every rank
        arrived, whether any rank's did (every rank then keeps its open step: `StepRecorder.close`).

        The ranks agree on one outcome, atomically (the store's compare-and-set): "all", set by the last rank
        to arrive, or "gave up", set by a rank that waited FINISH_WAIT_S. Whichever comes first holds for every
        rank, so a rank arriving after another gave up never gathers alone with a rank that has left. The wait
        is short polls, not one blocking call: a SIGTERM handler, and the watchdog's own store calls on the
        same client, run while this rank waits. `give_up`, asked at each poll, may end the wait early with why."""
        store = default_store()
        if store is None:
            return None
        key = f"{self.store_prefix}/finish"
        outcome_key = f"{key}/outcome"
        if skipped:
            store.set(f"{key}/skipped", "1")
        store.set(f"{key}/{self.rank}", "1")
        # One counter and one key to wait on, not W keys per rank: the store's work stays O(W) at any scale.
        outcome = None
        if int(store.add(f"{key}/arrived", 1)) >= self.world_size:
            outcome = store.compare_set(outcome_key, "", _ALL)
        else:
            deadline = time.monotonic() + FINISH_WAIT_S
            why = None
            while outcome is None and why is None and time.monotonic() < deadline:
                if store.check([outcome_key]):
                    outcome = store.get(outcome_key)
                else:
                    time.sleep(FINISH_POLL_S)
                    why = self._peer_disabled() or (give_up() if give_up is not None else None)
            if outcome is None:
                outcome = store.compare_set(outcome_key, "", _GAVE_UP)
            if outcome != _ALL and why is not None:
                return why
        if outcome == _ALL:
            self.skipped_at_finish = store.check([f"{key}/skipped"])  # (set before the arrival it came with)
            return None
        missing = [r for r in range(self.world_size) if not store.check([f"{key}/{r}"])]
        if missing:
            return f"ranks {missing} never reached finish(); their last steps are missing"
        return "another rank stopped waiting at finish() before this one arrived: no final gather"

    def _peer_disabled(self) -> str | None:
        """Why not to wait at finish for a rank whose scope disabled itself: it never comes."""
        try:
            self.check_peers_enabled()
        except PeerDisabled as exc:
            return f"{exc}: no final gather"
        return None

    def destroy(self) -> None:
        """Tear the scope's group down. After a final gather every rank took part in, the ranks meet once more
        first: a gloo group destroyed while a peer is still finishing the last collective can abort the
        process at exit ("terminate called without an active exception"; seen in 2 of 6 plain DDP runs
        without pytscope that tore down right after a collective, in 0 of 16 with a barrier first)."""
        if self.gatherer is not None:
            alive = dist_alive()
            if alive and self.met_at_finish:
                self.gatherer.barrier()
            self.gatherer.destroy(alive)
            self.gatherer = None


STORE_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, OSError, TimeoutError)
"""What a torch.distributed store raises when a key times out or its server is gone (DistStoreError and
DistNetworkError are RuntimeErrors): anything else is a bug and is not swallowed."""


def dist_alive() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def default_store() -> Any:
    """The key-value store of torch.distributed's default group, or None when not distributed."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.distributed_c10d._get_default_store()
    except (ImportError, RuntimeError, AttributeError):
        return None
    return None


def place_run(run_dir: Path | None, segment: int) -> tuple[Path, int]:
    """The run directory (`run_directory_for`) and segment of a launch. A resume (`segment` > 0: one past the
    checkpoint's) that finds later segments in the run (a second resume from the same checkpoint, after the
    first was lost too) takes the next one after them, so no two launches share a segment."""
    path = run_directory_for(run_dir, resumed=segment > 0)
    return path, max(segment, next_segment(path)) if segment > 0 else 0


def run_directory_for(
    run_dir: Path | None, resumed: bool, take: Callable[[Path], bool] = claim_run_dir
) -> Path:
    """Where a run goes: `run_dir`, or `runs/<date-time>` (absolute: a resume from another working directory
    finds it in the saved state). A new run never joins another: when `run_dir` already holds a run (one
    that claimed it first, if only by a moment) and this one is not its resume (no saved state was
    loaded), it goes to `run_dir-2` (-3 ...) and says so. `take` claims a directory for the run, or says
    that one has taken it (False): `claim_run_dir`, an exclusive create, so of two jobs started at once
    exactly one takes a name."""
    if run_dir is None:
        return _first_claimed(Path("runs").absolute() / time.strftime("%Y%m%d-%H%M%S"), take)
    if resumed:
        return run_dir
    path = _first_claimed(run_dir, take)
    if path != run_dir:
        print(
            f"pytscope: {run_dir} holds an earlier run and this one is not its resume (no saved scope state was "
            f"loaded): writing to {path}",
            file=sys.stderr,
            flush=True,
        )
    return path


def _first_claimed(base: Path, take: Callable[[Path], bool]) -> Path:
    """`base`, or the first of `base-2`, `base-3` ... that `take` takes. A path without a name of its own
    ("." or "..", a folder's `x/..`, the root) numbers the folder it stands for, made absolute first (the
    current folder's run goes beside it, not into `.-2`); the root's numbered ones go inside it."""
    if take(base):
        return base
    named = Path(os.path.abspath(base)) if base.name in ("", "..") else base
    n = 2
    while not take(path := _numbered(named, n)):
        n += 1
    return path


def _numbered(base: Path, n: int) -> Path:
    return base.with_name(f"{base.name}-{n}") if base.name else base / f"run-{n}"
