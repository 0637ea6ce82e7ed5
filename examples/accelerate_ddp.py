"""A small Accelerate data-parallel job watched by pytscope, runnable on CPU.

    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 examples/accelerate_ddp.py --straggler

An MLP learns a fixed random linear map (so the loss really goes down). `--straggler` makes the last rank
busy-wait ~4 ms per optimizer step (burning its core, as a slow shard would; a sleep would not load it).
`--save-at`, `--kill-at` and `--resume` exercise crash recovery: save a checkpoint, SIGKILL every rank
mid-run, then a new launch `load_state`s and continues the same pytscope run as a new segment.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, Dataset

from pytscope_accelerate import AccelerateScope

BATCH = 1024  # enough compute per step that gradient communication is not the story on CPU
STRAGGLER_SPIN_MS = 4.0


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps to train in total")
    p.add_argument("--straggler", action="store_true", help="the last rank busy-waits ~4 ms per step")
    p.add_argument(
        "--spin-ms", type=float, default=STRAGGLER_SPIN_MS, help="the straggler's busy-wait per step"
    )
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument(
        "--dynamo-backend",
        default=None,
        help='compile the prepared model with torch.compile and this backend (e.g. "inductor", "aot_eager")',
    )
    p.add_argument("--save-at", type=int, default=None, help="accelerator.save_state after this step")
    p.add_argument("--kill-at", type=int, default=None, help="every rank SIGKILLs itself after this step")
    p.add_argument("--resume", default=None, help="checkpoint directory to load_state from")
    p.add_argument("--checkpoint-dir", default="checkpoints/accelerate_ddp", help="where --save-at saves")
    p.add_argument("--run-dir", default=None, help="pytscope run directory (default runs/<timestamp>)")
    p.add_argument("--interval", type=int, default=50, help="steps between pytscope's cross-rank gathers")
    p.add_argument("--no-console", action="store_true", help="no live findings or summary on the console")
    p.add_argument(
        "--same-data",
        action="store_true",
        help="a bug on purpose: the loader is not prepared, so not sharded",
    )
    p.add_argument("--block-at", type=int, default=None, help="the last rank blocks forever at this step")
    p.add_argument("--hang-timeout", type=float, default=None, help='seconds (default: "auto")')
    # Misuse that pytscope must survive (exercised by the tests):
    p.add_argument("--forget-finish", action="store_true", help="call neither finish() nor end_training()")
    p.add_argument("--end-without-finish", action="store_true", help="call end_training() but not finish()")
    p.add_argument("--finish-twice", action="store_true", help="call scope.finish() twice")
    p.add_argument("--finish-after-end", action="store_true", help="call finish() after end_training()")
    return p.parse_args(argv)


class SyntheticData(Dataset):
    """A learnable task (a fixed random linear map) of any length, served from a small pool of samples.

    Whole batches are fetched at once (`__getitems__` plus an identity collate), so the data phase stays
    small and the data loader is not what the example measures.
    """

    def __init__(self, length: int, pool: int = 8192) -> None:
        gen = torch.Generator().manual_seed(0)
        teacher = torch.randn(64, 10, generator=gen)
        self.x = torch.randn(pool, 64, generator=gen)
        self.y = (self.x @ teacher).argmax(dim=1)
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i % len(self.x)], self.y[i % len(self.y)]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.tensor(indices) % len(self.x)
        return self.x[idx], self.y[idx]


def whole_batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum, dynamo_backend=args.dynamo_backend)
    # Exactly one epoch of batches for the whole run on every rank, so the example needs no epoch loop.
    dataset = SyntheticData(args.steps * args.grad_accum * BATCH * accelerator.num_processes)
    loader = DataLoader(dataset, batch_size=BATCH, collate_fn=whole_batch)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if args.same_data:
        model, optimizer = accelerator.prepare(model, optimizer)  # every rank iterates the whole dataset
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    scope = AccelerateScope(
        accelerator,
        args.run_dir,
        interval=args.interval,
        console=not args.no_console,
        hang_timeout=args.hang_timeout or "auto",
    )
    scope.watch(model, optimizer, loader)
    accelerator.register_for_checkpointing(scope)

    batches = loader
    if args.resume:
        accelerator.load_state(args.resume)  # also hands the checkpointed scope state to every rank
        # accelerator.step counts micro-batches and is restored by load_state: skip the ones already trained.
        batches = accelerator.skip_first_batches(loader, accelerator.step)
        scope.watch(loader=batches)
    step = accelerator.step // args.grad_accum
    slow = (
        args.straggler
        and accelerator.num_processes > 1
        and accelerator.process_index == accelerator.num_processes - 1
    )

    model.train()
    for x, y in batches:
        with accelerator.accumulate(model):
            if slow:
                spin(args.spin_ms / args.grad_accum)
            last_rank = accelerator.process_index == accelerator.num_processes - 1
            if last_rank and accelerator.num_processes > 1 and step + 1 == args.block_at:
                spin(3600e3)  # never reaches this step's all-reduce: the scope's watchdog ends the job
            loss = F.cross_entropy(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        scope.log(loss=loss)
        if not accelerator.sync_gradients:
            continue
        step += 1
        if step == args.save_at:
            with scope.paused():  # checkpointing is not charged to the training step
                accelerator.save_state(args.checkpoint_dir)
        if step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if step >= args.steps:
            break

    if args.forget_finish:
        return  # neither finish() nor end_training(): the summary comes from pytscope's exit hook
    if args.end_without_finish:
        accelerator.end_training()  # the exit hook finishes after the process group is gone: says so
        return
    if args.finish_after_end:
        accelerator.end_training()
        scope.finish()  # too late: says so on stderr and in the summary, and does not crash
        return
    scope.finish()  # collective: before end_training() destroys the process group
    if args.finish_twice:
        scope.finish()
    accelerator.end_training()


if __name__ == "__main__":
    main()
