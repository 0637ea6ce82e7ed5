"""The cross-rank exchange: every rank's step records of a window, on a process group of the scope's own.

Two all_gathers on a gloo group with a timeout, CPU tensors only, so the scope never touches the training's
streams or communicator. The first carries a fixed-size header with each rank's cumulative counters, so
ranks that disagree on how many steps they took are seen before any records move; the second carries the
records, padded to the longest window.
"""

from __future__ import annotations

import contextlib
import datetime
from dataclasses import dataclass
from typing import Any

import numpy as np

from .records import NCOLS

HEADER = ("steps", "grad_syncs", "micro_batches", "rows", "checksum")


@dataclass(frozen=True)
class Exchange:
    headers: np.ndarray  # (world, len(HEADER))
    rows: np.ndarray  # (n, NCOLS): every rank's rows of the window


class Gatherer:
    def __init__(self, timeout_s: float = 600.0) -> None:
        import torch.distributed as dist

        self._dist = dist
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        # new_group is collective: every rank creates it at the same point (the first loop top).
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        self._dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        import torch

        t = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        self._dist.all_gather(out, t, group=self.group)
        return [o.tolist() for o in out]

    def exchange(self, counters: tuple[float, ...], rows: np.ndarray) -> Exchange:
        import torch

        header = torch.tensor([*counters[:3], float(rows.shape[0]), counters[3]], dtype=torch.float64)
        headers = [torch.empty_like(header) for _ in range(self.world_size)]
        self._dist.all_gather(headers, header, group=self.group)
        h = torch.stack(headers).numpy()
        width = int(h[:, HEADER.index("rows")].max()) if h.size else 0
        if width == 0:
            return Exchange(h, np.empty((0, NCOLS)))
        padded = torch.full((width, NCOLS), float("nan"), dtype=torch.float64)
        padded[: rows.shape[0]] = torch.from_numpy(rows)
        out = [torch.empty_like(padded) for _ in range(self.world_size)]
        self._dist.all_gather(out, padded, group=self.group)
        every = torch.cat(out).numpy()
        return Exchange(h, every[~np.isnan(every[:, 0])])

    def destroy(self, dist_alive: bool = True) -> None:
        """Destroy the group (unless the default group is already gone, with ours in it) and drop it, so that
        its gloo threads are joined now and not while the interpreter shuts down."""
        if dist_alive:
            with contextlib.suppress(Exception):  # best effort at the end of a run
                self._dist.destroy_process_group(self.group)
        self.group = None
