"""A tiny DDP job that `tests/test_nodes.py` launches with two `torchrun` processes playing two nodes.

Each launcher gives its workers a host name through `PYTSCOPE_HOST`; `--slow-host` makes that host's ranks
(or, with `--slow-local-rank`, one of them) busy-wait `--spin-ms` per step. Steps are compute-light, so four
processes share two cores without the injected slowdown drowning in scheduling noise. Every rank writes the
payload bytes of its gathers (sent, received) to `--out/traffic-rank<N>.json`. `--raise-at STEP` makes rank 1
raise at that step, never calling `finish()`: the end a crash leaves to the interpreter's exit; `--kill-at STEP`
makes it SIGKILL itself there, as the out-of-memory killer would: nothing of its own is written.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from pytscope_core import Scope


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--interval", type=int, default=25)
    p.add_argument("--slow-host", default=None)
    p.add_argument("--slow-local-rank", type=int, default=None)
    p.add_argument("--spin-ms", type=float, default=4.0)
    p.add_argument("--raise-at", type=int, default=None)
    p.add_argument("--exit-at", type=int, default=None, help="rank 1 calls sys.exit(3) there")
    p.add_argument("--kill-at", type=int, default=None, help="rank 1 SIGKILLs itself there")
    p.add_argument("--hang-timeout", default=None, help='"auto", or seconds (default: no hang detection)')
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    hang_timeout = args.hang_timeout if args.hang_timeout in (None, "auto") else float(args.hang_timeout)
    scope = Scope(args.run_dir, interval=args.interval, console=False, hang_timeout=hang_timeout)
    scope.watch(ddp, opt)
    slow = os.environ.get("PYTSCOPE_HOST") == args.slow_host and args.slow_local_rank in (None, local_rank)
    gen = torch.Generator().manual_seed(rank)
    teacher = torch.randn(32, 4, generator=torch.Generator().manual_seed(0))
    for step in range(1, args.steps + 1):
        if rank == 1 and step == args.raise_at:
            raise RuntimeError(f"injected failure [rank {rank}, step {step}]")  # brackets: not rich markup
        if rank == 1 and step == args.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == 1 and step == args.exit_at:
            sys.exit(
                3
            )  # an exit decided on this rank alone (a NaN guard, early stopping), finish() not called
        x = torch.randn(64, 32, generator=gen)
        if slow:
            spin(args.spin_ms)
        loss = F.cross_entropy(ddp(x), (x @ teacher).argmax(1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        scope.log(loss=loss)
    traffic = list(scope.session.traffic) if scope.session is not None else []
    scope.finish()
    Path(args.out, f"traffic-rank{rank}.json").write_text(json.dumps(traffic))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
