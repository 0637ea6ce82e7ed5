"""A real 2-rank gloo DDP job with uneven inputs under DDP's `join()`: rank 1 has fewer batches per epoch.

Options: `batches` (per rank, a list), `epochs`, `interval`, `loader` (watch a DataLoader, or iterate a plain
list), `gather_timeout`, `accumulate` (micro-batches per optimizer step, each syncing: no `no_sync()`),
`watch_inside` (watch the model inside the join's `with`). Each rank writes what its scope said into
`run_dir/rank<N>.json`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import forked

from pytscope_core.demo import free_port


def run(options: dict[str, Any]) -> None:
    forked.start(_main, (free_port(), options), 2)


def _main(rank: int, port: int, o: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from pytscope_core import Scope

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scope = Scope(o["run_dir"], interval=o["interval"], console=False, gather_timeout=o["gather_timeout"])
    gen = torch.Generator().manual_seed(rank)
    data = [torch.randn(64, 32, generator=gen) for _ in range(o["batches"][rank])]
    batches: Any = torch.utils.data.DataLoader(data, batch_size=None) if o["loader"] else data
    if not o.get("watch_inside"):
        scope.watch(ddp, opt, batches if o["loader"] else None)
    accumulate = o.get("accumulate", 1)
    for _ in range(o["epochs"]):
        with ddp.join():
            if o.get("watch_inside"):
                scope.watch(ddp, opt, batches if o["loader"] else None)
            for i, x in enumerate(batches, 1):
                loss = F.cross_entropy(ddp(x), x[:, :4].argmax(1))
                loss.backward()
                if i % accumulate == 0:
                    opt.step()
                    opt.zero_grad()
                    scope.log(loss=loss)
    said = {"errors": scope.errors, "steps_done": scope.recorder.steps_done}
    scope.finish()
    Path(o["run_dir"], f"rank{rank}.json").write_text(json.dumps(said))
    dist.barrier()
    dist.destroy_process_group()
