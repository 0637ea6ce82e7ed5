"""A small real FSDP2 job for the multi-process tests: gloo ranks forked from tests/forked.py's server.

By default two `fully_shard` units (one block and the root) and Adam, sized so that compute dominates the step
on 2 shared cores: about 190 ms per step, of which gloo's all-gathers and reduce-scatters (about 4 ms each on
such a machine, whatever their size) are about 15%. Options change the size (`width`, `batch`, `blocks`,
`repeat`), add forward work of a fixed wall time on every rank (`work_ms`), and inject one behaviour at a
time, always by busy-waiting (never sleeping): a slow last rank (`spin_ms`, or `slow_fraction` of the step as
measured on warm-up steps 2-5), a last rank slow in backward (`backward_ms`, inside the last block's backward),
work after each optimizer step on every rank (`after_step_ms`), a rank that blocks at one step or skips one
step's backward and optimizer step (a `continue` after the loss), gradient accumulation with
`set_requires_gradient_sync(False)` on all but the last micro-batch; `head=False` drops the output layer, so
that the root's output is its last block's (the hook shape of an nn.Sequential of sharded blocks);
`wrapper="tp"` trains the same model
tensor-parallel (DTensor), whose communication pytscope does not measure (FSDP1 would do as well, but it needs
an accelerator).
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from typing import Any

import forked
import torch

from pytscope_core.demo import free_port, spin

WIDTH = 512
BLOCKS = 1
REPEAT = 3
BATCH = 2048


def run(world: int, options: dict[str, Any]) -> None:
    forked.start(_main, (world, free_port(), options), world)


def make_model(
    wrapper: str,
    width: int = WIDTH,
    n_blocks: int = BLOCKS,
    repeat: int = REPEAT,
    head: bool = True,
    backward_ms: float = 0.0,
) -> Any:
    """Linear(32, width), then `n_blocks` blocks (each applies its own width x width layer `repeat` times: more
    compute per collective without more parameters to gather), then Linear(width, 4) (`head`). FSDP2: every
    block a unit, the whole model the root unit. `backward_ms`: the last block's backward busy-waits that long."""
    import torch

    torch.manual_seed(0)
    blocks = [Block(width, repeat, backward_ms if i == n_blocks - 1 else 0.0) for i in range(n_blocks)]
    tail = [torch.nn.Linear(width, 4)] if head else []
    model = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.ReLU(), *blocks, *tail)
    if wrapper == "tp":
        return _tensor_parallel(model, n_blocks)
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block)
    return fully_shard(model)


class Block(torch.nn.Module):
    def __init__(self, width: int, repeat: int, backward_ms: float = 0.0) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.repeat = repeat
        self.backward_ms = backward_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backward_ms:
            x = SpinInBackward.apply(x, self.backward_ms)
        for _ in range(self.repeat):
            x = torch.relu(self.linear(x))
        return x


class SpinInBackward(torch.autograd.Function):
    """The identity, whose backward busy-waits `ms`: compute inside backward, between FSDP's collectives."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, ms: float) -> torch.Tensor:
        ctx.ms = ms
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        spin(ctx.ms)
        return grad, None


def _tensor_parallel(model: Any, n_blocks: int) -> Any:
    """Megatron-style: the linear layers alternate column- and row-wise sharding over both ranks, so every
    second layer all-reduces its output inside forward (and its input gradient inside backward)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    assert n_blocks % 2 == 0, "column/row pairs need an even number of linear layers"
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    linears = ["0", *(f"{2 + i}.linear" for i in range(n_blocks)), str(2 + n_blocks)]
    plan = {name: ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i, name in enumerate(linears)}
    return parallelize_module(model, mesh, plan)


def _main(rank: int, world: int, port: int, o: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from pytscope_core import Scope

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = make_model(
        o.get("wrapper", "fsdp2"),
        o.get("width", WIDTH),
        o.get("blocks", BLOCKS),
        o.get("repeat", REPEAT),
        head=o.get("head", True),
        backward_ms=o.get("backward_ms", 0.0) if rank == world - 1 else 0.0,
    )
    if o.get("work_ms"):  # forward work that takes the same wall time on every rank, however busy the cores
        model[0].register_forward_pre_hook(lambda *_: spin(o["work_ms"]))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scope = Scope(
        o["run_dir"],
        interval=o.get("interval", 20),
        console=o.get("console", False),
        hang_timeout=o.get("hang_timeout", None),
        on_hang=o.get("on_hang", "abort"),
    )
    scope.watch(model, opt)
    micro = o.get("accumulate", 1)
    batch = o.get("batch", BATCH)
    gen = torch.Generator().manual_seed(rank)
    teacher = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    slow = rank == world - 1
    spin_ms = o.get("spin_ms", 0.0)
    started: list[float] = []
    for step in range(1, o["steps"] + 1):
        started.append(time.perf_counter())
        if slow and step == o.get("block_at"):
            spin(3600e3)
        if slow and o.get("slow_fraction") and step == 6:  # after warm-up: a share of this machine's step
            spin_ms = (
                o["slow_fraction"]
                * 1e3
                * statistics.median(b - a for a, b in itertools.pairwise(started[1:]))
            )
        for m in range(micro):
            x = torch.randn(batch // micro, 32, generator=gen)
            y = (x @ teacher).argmax(1)
            if slow and spin_ms:
                spin(spin_ms / micro)
            if micro > 1:
                model.set_requires_gradient_sync(
                    m == micro - 1
                )  # reduce-scatter on the last micro-batch only
            loss = F.cross_entropy(model(x), y) / micro
            if slow and step == o.get("skip_backward_at"):
                break
            loss.backward()
        else:
            opt.step()
        opt.zero_grad()
        if o.get("after_step_ms"):  # the loop's own work after the step (logging, a scheduler): `other`
            spin(o["after_step_ms"])
        scope.log(loss=loss * micro)
    scope.finish()
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.1)
