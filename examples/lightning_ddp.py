"""pytscope with PyTorch Lightning: a small DDP job on CPU that you can make slow on purpose.

    python examples/lightning_ddp.py                 # 2 healthy ranks: no HIGH or MED finding
    python examples/lightning_ddp.py --straggler     # the last rank busy-waits ~4 ms per step: named straggler
    pytscope report runs/lightning-ddp               # the report again, from the run directory

The straggler busy-waits instead of sleeping, so it burns its core the way a heavier shard or a slow
augmentation would. The model learns a fixed random linear map, so its loss really goes down.
"""

from __future__ import annotations

import argparse
import time

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from pytscope_lightning import ScopeCallback

STRAGGLER_SPIN_MS = 4.0
BATCH = 32


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


class Regressor(pl.LightningModule):
    def __init__(self, straggler: bool = False, spin_ms: float = STRAGGLER_SPIN_MS) -> None:
        super().__init__()
        self.straggler = straggler
        self.spin_ms = spin_ms
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 10),
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.straggler and self.global_rank == self.trainer.world_size - 1:
            spin(self.spin_ms)
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def dataset(samples: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(64, 10, generator=gen)
    x = torch.randn(samples, 64, generator=gen)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--straggler", action="store_true", help="the last rank busy-waits ~4 ms per step")
    parser.add_argument(
        "--spin-ms", type=float, default=STRAGGLER_SPIN_MS, help="the straggler's busy-wait per step"
    )
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--interval", type=int, default=50, help="steps between cross-rank gathers")
    parser.add_argument("--run-dir", default="runs/lightning-ddp")
    args = parser.parse_args()

    torch.set_num_threads(1)  # ranks share the host's cores; one thread each keeps them from fighting
    loader = DataLoader(dataset(args.steps * BATCH * args.devices), batch_size=BATCH, shuffle=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="ddp" if args.devices > 1 else "auto",
        max_steps=args.steps,
        callbacks=[ScopeCallback(run_dir=args.run_dir, interval=args.interval)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regressor(straggler=args.straggler, spin_ms=args.spin_ms), loader)


if __name__ == "__main__":
    main()
