"""A small Lightning fit under ModelParallelStrategy (FSDP2 via `configure_model`) on CPU, with ScopeCallback.

Run as its own process by tests/test_fsdp.py: the strategy launches the other rank by re-running this script.
`--spin-ms` busy-waits on the last rank in every training_step, `--backward-spin-ms` in the last block's
backward; `--no-head` drops the output layer, so that the root's output is its last sharded block's (an
nn.Sequential of sharded blocks); `--accumulate` accumulates micro-batches (the strategy keeps FSDP2's gradient
sync on for every micro-batch). Rank 0 writes what the trainer saw to `--result`.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.utils.data import DataLoader, TensorDataset

from pytscope_lightning import ScopeCallback


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


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


class SlowBackward(torch.nn.Module):
    def __init__(self, ms: float) -> None:
        super().__init__()
        self.ms = ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SpinInBackward.apply(x, self.ms) if self.ms else x


class Job(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.slow = SlowBackward(0.0)  # set on the last rank once the trainer knows the ranks
        blocks = [
            torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.ReLU()) for _ in range(2)
        ]
        blocks[-1].insert(0, self.slow)
        head = [] if args.no_head else [torch.nn.Linear(args.width, 8)]
        self.net = torch.nn.Sequential(torch.nn.Linear(32, args.width), torch.nn.ReLU(), *blocks, *head)
        self.teacher = torch.randn(32, 8, generator=torch.Generator().manual_seed(0))

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        if self.global_rank == self.trainer.world_size - 1:
            self.slow.ms = self.args.backward_spin_ms
        for block in self.net[2:4]:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)  # the root unit: training_step calls it, not the LightningModule

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        if self.args.spin_ms and self.global_rank == self.trainer.world_size - 1:
            spin(self.args.spin_ms)
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self) -> DataLoader:
        n = self.args.batch * self.args.steps * self.args.accumulate * self.trainer.world_size
        x = torch.randn(n, 32, generator=torch.Generator().manual_seed(1))
        return DataLoader(TensorDataset(x, (x @ self.teacher).argmax(dim=1)), batch_size=self.args.batch)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--spin-ms", type=float, default=0.0)
    p.add_argument("--backward-spin-ms", type=float, default=0.0)
    p.add_argument("--no-head", action="store_true")
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--result", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    callback = ScopeCallback(run_dir=args.run_dir, interval=10, console=False, hang_timeout=None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Job(args))
    if trainer.global_rank == 0 and args.result:
        with open(args.result, "w") as f:
            json.dump({"global_step": trainer.global_step}, f)


if __name__ == "__main__":
    main()
