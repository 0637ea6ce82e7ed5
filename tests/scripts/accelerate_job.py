"""An Accelerate loop with `AccelerateScope`, run under torchrun by tests/test_accelerate.py, for what the
example does not do: the loop's own collectives (`wait_for_everyone`, `reduce`) and a loop started again
after a caught exception, as `find_executable_batch_size` does after an out-of-memory error.

Rank 0 writes what the loop saw to `--result`.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

from pytscope_accelerate import AccelerateScope


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def train(accelerator: Accelerator, args: argparse.Namespace, attempt: int) -> int:
    """One attempt: raises on its 5th step if it is not the last one."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.steps * 16 * accelerator.num_processes, 32, generator=gen)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    scope = AccelerateScope(
        accelerator, args.run_dir, interval=25, console=True, hang_timeout=args.hang_timeout
    )
    scope.watch(model, optimizer, loader)
    accelerator.register_for_checkpointing(scope)
    slow = accelerator.process_index == accelerator.num_processes - 1 and accelerator.num_processes > 1
    steps = 0
    for step, (xb, yb) in enumerate(loader, start=1):
        if attempt < args.attempts - 1 and step == 5:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        loss = F.mse_loss(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        scope.log(loss=loss)
        steps += 1
        if slow:
            spin(
                args.late_spin_ms
            )  # after the gradient all-reduce: the others wait in the loop's collectives
        if args.collectives:
            accelerator.reduce(loss.detach(), reduction="mean")
            accelerator.wait_for_everyone()
        time.sleep(args.step_sleep_s)
    scope.finish()
    return steps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--late-spin-ms", type=float, default=0.0, help="the last rank's work after each step")
    p.add_argument(
        "--collectives", action="store_true", help="accelerator.reduce and wait_for_everyone per step"
    )
    p.add_argument("--attempts", type=int, default=1, help="the loop raises and starts again until the last")
    p.add_argument("--hang-timeout", type=float, default=None)
    p.add_argument("--step-sleep-s", type=float, default=0.0)
    p.add_argument("--result", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    accelerator = Accelerator()
    for attempt in range(args.attempts):
        try:
            steps = train(accelerator, args, attempt)
        except RuntimeError:  # what find_executable_batch_size catches, before it calls the loop again
            continue
    if args.result and accelerator.is_main_process:
        with open(args.result, "w") as f:
            json.dump(
                {
                    "steps": steps,
                    "registered": len(accelerator._custom_objects),
                    "collectives_as_they_were": "reduce" not in accelerator.__dict__,
                },
                f,
            )
    accelerator.end_training()


if __name__ == "__main__":
    main()
