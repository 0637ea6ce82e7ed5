"""The cross-rank exchange: every rank's step records of a window, to rank 0, on a process group of the scope's own.

A gloo group with a timeout, CPU tensors only, so the scope never touches the training's streams or
communicator. Only rank 0 reads the records, so they travel one way: each rank sends one fixed-size block (a
header row with its cumulative counters, then up to `capacity` rows of its window) with `dist.gather`, and
receives two numbers back (`dist.broadcast`: how many rows beyond the capacity the longest window holds,
almost always 0, and when it is not a second gather carries the tail; and the gradient syncs per optimizer
step, by which every rank schedules its next gathers: `syncs_per_step`). Bytes per rank and interval are
constant in the world size; rank 0 receives O(W). Rank 0 sees every header, so ranks that disagree on how many steps
they took are seen (DIST.DESYNC) even though every rank met at the same collective.

The group is created with gloo's lazy connections (`TORCH_GLOO_LAZY_INIT=1` around `new_group`, unless the
variable is set already): pairs connect on first use, so a gather to rank 0 opens O(W) connections in all
instead of the W x (W - 1) of a full mesh that every rank would open at creation (torch >= 2.8: earlier
versions ignore the variable and open the full mesh).
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .records import NCOLS

HEADER = ("steps", "grad_syncs", "micro_batches", "rows", "checksum", "joined_at")
"""A rank's header at a gather: its cumulative counters, how many rows follow, its replica checksum and, while
it is out of batches inside torch's Join, its last step (NaN otherwise: see joins.py)."""
HOST_BYTES = 256  # a host name in the start-time placement gather (longer names are cut)
LAZY_ENV = "TORCH_GLOO_LAZY_INIT"


@dataclass(frozen=True)
class Exchange:
    headers: np.ndarray  # (world, len(HEADER))
    rows: np.ndarray  # (n, NCOLS): every rank's rows of the window


@dataclass
class Traffic:
    """Payload bytes of the last exchange on this rank, from the tensors' sizes (not counting gloo framing)."""

    sent: int = 0
    received: int = 0


class Gatherer:
    def __init__(self, timeout_s: float = 600.0, capacity: int = 50) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.capacity = max(1, capacity)  # rows per rank in the fixed-size block: the gather interval
        self.traffic = Traffic()
        self.syncs_per_step = 1  # as rank 0 last told every rank (`syncs_per_step`)
        t0 = time.perf_counter()
        # new_group is collective: every rank creates it at the same point (the first loop top).
        with _lazy_connections():
            self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.create_ms = (time.perf_counter() - t0) * 1e3

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather_places(self, host: str, local_rank: int) -> list[tuple[str, int]] | None:
        """Every rank's (host, local rank) on rank 0 (None elsewhere): one fixed-size gather."""
        import torch

        name = host.encode()[:HOST_BYTES]
        mine = torch.zeros(HOST_BYTES + 2, dtype=torch.int64)
        mine[0], mine[1] = len(name), local_rank
        mine[2 : 2 + len(name)] = torch.tensor(list(name), dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.world_size)] if self.rank == 0 else None
        self._dist.gather(mine, every, dst=0, group=self.group)
        if every is None:
            return None
        out = []
        for t in every:
            n, local, *chars = t.tolist()
            out.append((bytes(chars[:n]).decode(errors="replace"), int(local)))
        return out

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        import torch

        t = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._dist.all_gather(out, t, group=self.group)
        return [o.tolist() for o in out]

    def exchange(self, counters: tuple[float, ...], rows: np.ndarray) -> Exchange | None:
        """Send this rank's counters and rows to rank 0; rank 0 returns everyone's, the others None."""
        import torch

        cap, n = self.capacity, rows.shape[0]
        block = torch.full((1 + cap, NCOLS), float("nan"), dtype=torch.float64)
        block[0, : len(HEADER)] = torch.from_numpy(header_row(counters, n))
        if n:
            block[1 : 1 + min(n, cap)] = torch.from_numpy(rows[:cap])
        blocks = self._gather(block)
        stacked = torch.stack(blocks).numpy() if blocks is not None else None
        # Rows beyond the capacity on the longest window, and the syncs per step every rank schedules by.
        told = torch.zeros(2, dtype=torch.int64)
        if stacked is not None:
            told[0] = max(0, int(stacked[:, 0, HEADER.index("rows")].max()) - cap)
            told[1] = syncs_per_step(stacked[:, 0, : len(HEADER)])
        self._dist.broadcast(told, src=0, group=self.group)
        width, self.syncs_per_step = int(told[0]), int(told[1])
        tails = None
        if width:
            tail = torch.full((width, NCOLS), float("nan"), dtype=torch.float64)
            if n > cap:
                tail[: n - cap] = torch.from_numpy(rows[cap:])
            tails = self._gather(tail)
        self._count(block.numel() + (width * NCOLS if width else 0))
        if stacked is None:
            return None
        parts = [stacked[:, 1:].reshape(-1, NCOLS)]
        if tails is not None:
            parts.append(torch.cat(tails).numpy())
        every = np.concatenate(parts)
        return Exchange(stacked[:, 0, : len(HEADER)].copy(), every[~np.isnan(every[:, 0])])

    def _gather(self, tensor: Any) -> list[Any] | None:
        out = [tensor.new_empty(tensor.shape) for _ in range(self.world_size)] if self.rank == 0 else None
        self._dist.gather(tensor, out, dst=0, group=self.group)
        return out

    def _count(self, numbers: int) -> None:
        """Payload of this exchange: each rank sends its blocks to rank 0 and gets one int64 back."""
        if self.rank == 0:
            self.traffic = Traffic(
                sent=16 * (self.world_size - 1), received=8 * numbers * (self.world_size - 1)
            )
        else:
            self.traffic = Traffic(sent=8 * numbers, received=16)

    def barrier(self) -> None:
        # Best effort at the end of a run, bounded by the group's timeout.
        with contextlib.suppress(Exception):
            self._dist.barrier(group=self.group)

    def destroy(self, dist_alive: bool = True) -> None:
        """Destroy the group (unless the default group is already gone, with ours in it) and drop it, so that
        its gloo threads are joined now and not while the interpreter shuts down."""
        if dist_alive:
            with contextlib.suppress(Exception):  # best effort at the end of a run
                self._dist.destroy_process_group(self.group)
        self.group = None


def header_row(counters: tuple[float, ...], rows: int) -> np.ndarray:
    """One rank's `HEADER` from its counters (steps, syncs, micro-batches, checksum, joined_at) and rows."""
    steps, syncs, micro, checksum, joined_at = counters
    return np.array([steps, syncs, micro, float(rows), checksum, joined_at], dtype=np.float64)


def syncs_per_step(headers: np.ndarray) -> int:
    """Gradient syncs per optimizer step, from every rank's cumulative counters at a gather (`HEADER` rows):
    the fewest syncs over the most steps, rounded down, at least 1. Several where each step syncs several
    times (accumulation without no_sync()); a rank that skipped a step, or a GradScaler's skipped first
    steps, never stretch it. Computed on rank 0 and sent to every rank: ranks never disagree on it."""
    steps, syncs = float(np.max(headers[:, 0])), float(np.min(headers[:, 1]))
    return max(1, int(syncs // steps)) if steps >= 1 and math.isfinite(syncs) else 1


@contextlib.contextmanager
def _lazy_connections() -> Iterator[None]:
    """Gloo's lazy pair connections for the group created inside (read when the group is created); a value the
    user set is left alone (`TORCH_GLOO_LAZY_INIT=0` restores the full mesh)."""
    if LAZY_ENV in os.environ:
        yield
        return
    os.environ[LAZY_ENV] = "1"
    try:
        yield
    finally:
        os.environ.pop(LAZY_ENV, None)
