"""A tiny real DDP job for the multi-process tests: gloo ranks forked from tests/forked.py's server.

Options inject one behaviour at a time, always by busy-waiting (never sleeping): a slow rank, a rank that
blocks at one step, a rank whose every step is slow but progressing, a rank that skips one gradient sync,
a NaN loss on one rank that every rank skips,
batches from a watched DataLoader,
forward work of a fixed wall time on every rank, a model with two heads of which each rank uses its own
choice every step.
"""

from __future__ import annotations

import math
import os
import signal
import time
from typing import Any

import forked

from pytscope_core.demo import free_port, spin


def run(world: int, options: dict[str, Any]) -> None:
    forked.start(_main, (world, free_port(), options), world)


def _main(rank: int, world: int, port: int, o: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from pytscope_core import Scope

    torch.set_num_threads(1)
    if o.get("warmup_hang_s"):  # the warm-up hang rule's 5 minutes, shortened for a test
        import pytscope_core.session

        pytscope_core.session.AUTO_WARMUP_S = o["warmup_hang_s"]
    if o.get("finish_wait_s"):  # how long finish() waits for the other ranks, shortened for a test
        import pytscope_core.coordinator

        pytscope_core.coordinator.FINISH_WAIT_S = o["finish_wait_s"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if o.get("stale_keys"):  # a restarted launch, whose store (torchrun's) holds what the last one left
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
        if rank == 0:
            for key, value in o["stale_keys"].items():
                dist.distributed_c10d._get_default_store().set(key, value)
        dist.barrier()
    torch.manual_seed(0)
    model = TwoHeads() if o.get("heads") else torch.nn.Sequential(*_layers(o.get("batchnorm", False)))
    if o.get("work_ms"):  # forward work that takes the same wall time on every rank, however busy the cores
        model.register_forward_pre_hook(lambda *_: spin(o["work_ms"]))
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=bool(o.get("heads")))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    scope = Scope(
        o["run_dir"],
        interval=o.get("interval", 20),
        console=False,
        hang_timeout=o.get("hang_timeout", None),
        on_hang=o.get("on_hang", "abort"),
        gather_timeout=o.get("gather_timeout", 300.0),
    )
    # Each rank draws its own data, unless `same_data`: a loop without a DistributedSampler.
    gen = torch.Generator().manual_seed(0 if o.get("same_data") else rank)
    batches = None
    if o.get("loader"):  # the same draws, fetched from a watched DataLoader
        data = torch.utils.data.TensorDataset(
            torch.randn(o["steps"] * o.get("batch", 512), 32, generator=gen)
        )
        loader = torch.utils.data.DataLoader(data, batch_size=o.get("batch", 512))
        scope.watch(ddp, opt, loader)
        batches = iter(loader)
    else:
        scope.watch(ddp, opt)
    teacher = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    heads = torch.Generator().manual_seed(100 + rank)  # each rank its own choice of head
    for step in range(1, o["steps"] + 1):
        # Compute-dominated steps: a few ms against ~0.3 ms of all-reduce (more with a larger `batch`).
        x = next(batches)[0] if batches is not None else torch.randn(o.get("batch", 512), 32, generator=gen)
        y = (x @ teacher).argmax(1)
        slow = rank == world - 1
        if slow and o.get("spin_ms"):
            spin(o["spin_ms"])
        if slow and step == o.get("block_at"):
            spin(3600e3)
        if slow and step == o.get("sigterm_at"):
            os.kill(os.getpid(), signal.SIGTERM)  # what a launcher sends before SIGKILL
        if rank == 0 and o.get("eval_every") and step % o["eval_every"] == 0:
            with scope.paused():  # evaluation on rank 0 only, as many DDP scripts do
                spin(o["eval_ms"])
        logs = o.get("log_only_on", rank) == rank  # (a loop may log its loss on one rank only)
        if step in o.get("nan_guard_at", ()):  # the last rank's loss is NaN: every rank agrees to skip
            loss = F.cross_entropy(ddp(x * (math.nan if slow else 1.0)), y)
            if logs:
                scope.log(loss=loss)
            finite = torch.isfinite(loss.detach()).float().reshape(1)
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
            if not finite.item():
                continue
        if step == o.get("break_at"):  # a forward and its loss logged, then the loop ends
            scope.log(loss=F.cross_entropy(ddp(x), y))
            break
        if o.get("skip_sync_at") == step and slow:
            with ddp.no_sync():
                loss = F.cross_entropy(ddp(x), y)
                loss.backward()
        elif o.get("heads"):
            loss = F.cross_entropy(ddp(x, int(torch.randint(0, 2, (1,), generator=heads))), y)
            loss.backward()
        else:
            loss = F.cross_entropy(ddp(x), y)
            if slow and step == o.get("block_before_backward"):  # the step has opened: past its loop top
                spin(3600e3)
            loss.backward()
        if not (slow and step == o.get("skip_step_at")):  # a rank-local guard (`if loss.isfinite()`)
            opt.step()
        opt.zero_grad()
        if logs:
            scope.log(loss=loss)
        if slow and o.get(
            "spin_after_ms"
        ):  # after its optimizer step: the others wait in the next collective
            spin(o["spin_after_ms"])
        if o.get("loss_all_reduce"):  # the mean loss for logging, as many scripts compute it
            dist.all_reduce(loss.detach())
        if slow and step == o.get("block_after"):  # after its optimizer step: the others reach the gather
            spin(3600e3)
    if rank == 0 and o.get("late_finish_ms"):  # e.g. a final evaluation on rank 0 only
        spin(o["late_finish_ms"])
    if o.get("barrier_at_end"):  # every rank waits for it before saving (accelerator.wait_for_everyone())
        dist.barrier()
    scope.finish()
    # The scope's own gloo group is gone with its last reference: its threads are not left for the
    # interpreter's shutdown.
    assert scope.coordinator.gatherer is None
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.1)


def _layers(batchnorm: bool = False) -> list[Any]:
    import torch

    norm = [torch.nn.BatchNorm1d(256)] if batchnorm else []  # (buffers DDP broadcasts at each forward)
    return [torch.nn.Linear(32, 256), *norm, torch.nn.ReLU(), torch.nn.Linear(256, 4)]


def TwoHeads() -> Any:  # noqa: N802 - a class, built where torch is imported (in the rank's process)
    import torch

    class Model(torch.nn.Module):
        """A shared trunk and two heads; each forward uses one head (multi-task training)."""

        def __init__(self) -> None:
            super().__init__()
            self.trunk = torch.nn.Sequential(*_layers()[:2])
            self.heads = torch.nn.ModuleList([torch.nn.Linear(256, 4), torch.nn.Linear(256, 4)])

        def forward(self, x: Any, head: int = 0) -> Any:
            return self.heads[head](self.trunk(x))

    return Model()
