"""`pytscope demo`: a small real DDP job on CPU (gloo, spawned processes) with one fault injected.

Faults are injected by busy-waiting, not sleeping, so the slow rank really burns its core the way a slow
data loader or a heavier shard does. The model is a small MLP learning a fixed random linear map, so the
loss genuinely goes down in a healthy run.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

SCENARIOS = ("straggler", "healthy", "hang", "input", "spike")
STRAGGLER_SPIN_MS = 4.0  # extra local work of the slow rank per step
INPUT_SPIN_MS = 6.0  # extra time per batch in the data loader (every rank)
SPIKE_STEPS = (160, 230)  # steps whose inputs are scaled up, so the loss really jumps
HANG_STEP = 30  # step at which the last rank stops joining the collectives
BATCH = 1024  # samples per rank per step
NEEDS_RANKS = {"straggler": 2, "hang": 2}  # a fault between ranks needs another rank to wait for it
NEEDS_STEPS = {"hang": HANG_STEP, "spike": SPIKE_STEPS[-1]}  # the fault's last step
MAX_RANKS = 64
MAX_STEPS = 5_000  # every step's data is made up front: about 130 KB per rank and step


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


def run_demo(
    scenario: str = "straggler",
    ranks: int = 2,
    steps: int = 300,
    run_dir: str | os.PathLike[str] | None = None,
    interval: int = 50,
    console: bool = True,
    placed: bool = False,
) -> Path:
    """Spawn `ranks` processes, train `steps` steps with the fault, and return the run directory
    (`demo_run_dir`; `placed`: `run_dir` is its choice already, made and claimed for this job)."""
    import torch.multiprocessing as mp

    check_demo(scenario, ranks, steps)
    path = Path(run_dir) if placed and run_dir is not None else demo_run_dir(scenario, run_dir)
    options = dict(scenario=scenario, steps=steps, run_dir=str(path), interval=interval, console=console)
    # The hang scenario ends in the abort it shows: torch's warning that it ends the ranks still running is noise.
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")
    level = spawn_log.level
    if scenario == "hang":
        spawn_log.setLevel(logging.ERROR)
    try:
        mp.start_processes(
            _worker, args=(ranks, free_port(), options), nprocs=ranks, start_method="spawn", join=True
        )
    except mp.ProcessExitedException as exc:
        if scenario != "hang":
            raise
        print(f"the job ended with exit code {exc.exit_code} after the hang was detected (on_hang='abort')")
    finally:
        spawn_log.setLevel(level)
    return path


def check_demo(scenario: str, ranks: int, steps: int) -> None:
    """ValueError, saying why, for a scenario that does not exist or cannot be shown on `ranks` ranks in
    `steps` steps."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r} (choose from {', '.join(SCENARIOS)})")
    needed = NEEDS_RANKS.get(scenario, 1)
    if ranks < needed:
        why = " (a fault between ranks needs another rank to wait for it)" if needed > 1 else ""
        raise ValueError(f"the {scenario} scenario needs --ranks {needed} or more{why}")
    if ranks > MAX_RANKS:
        raise ValueError(f"--ranks must be at most {MAX_RANKS} (processes on this machine)")
    if not NEEDS_STEPS.get(scenario, 0) < steps <= MAX_STEPS:
        least = NEEDS_STEPS.get(scenario, 0) + 1
        fault = f" (its fault comes by step {least - 1})" if least > 1 else ""
        raise ValueError(f"the {scenario} scenario takes --steps from {least}{fault} to {MAX_STEPS}")


def demo_run_dir(scenario: str, run_dir: str | os.PathLike[str] | None) -> Path:
    """Where the demo's run goes, made before the job starts (OSError when it cannot be): `run_dir` (default
    runs/demo-<scenario>-<time>), or `run_dir-2` (-3 ...) when it holds an earlier run, as a Scope would choose;
    claimed, and handed over to the job's rank 0 (`hand_over_claim`)."""
    from .coordinator import run_directory_for

    default = Path("runs") / f"demo-{scenario}-{time.strftime('%Y%m%d-%H%M%S')}"
    path = run_directory_for(Path(run_dir) if run_dir is not None else default, resumed=False)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _worker(rank: int, world: int, port: int, options: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from .output import PipeSafeStdout
    from .rundir import hand_over_claim
    from .scope import Scope

    if sys.stdout is not None:  # rank 0 prints to the demo's reader, who may stop reading (| head)
        sys.stdout = PipeSafeStdout(sys.stdout)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    scenario, steps = options["scenario"], options["steps"]
    hand_over_claim(options["run_dir"])
    try:
        model, loader = _job(rank, steps, input_spin_ms=INPUT_SPIN_MS if scenario == "input" else 0.0)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
        scope = Scope(
            options["run_dir"],
            interval=options["interval"],
            console=options["console"] and rank == 0,
            hang_timeout=5.0 if scenario == "hang" else "auto",
            integration="demo",
        )
        scope.watch(ddp, optimizer, loader)
        step = 0
        for x, y in loader:
            step += 1
            if scenario == "straggler" and rank == world - 1 and world > 1:
                spin(STRAGGLER_SPIN_MS)
            if scenario == "spike" and step in SPIKE_STEPS:
                x = x * 25.0
            if scenario == "hang" and rank == world - 1 and world > 1 and step == HANG_STEP:
                spin(3600e3)  # never joins this step's all-reduce; the scope's watchdog ends the job
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scope.log(loss=loss)
        scope.finish()
    finally:
        dist.destroy_process_group()


def _job(rank: int, steps: int, input_spin_ms: float) -> tuple[Any, Any]:
    """The model and this rank's loader: its own shard of samples of one teacher (the same map on every rank),
    made here, so a rank's memory does not grow with the number of ranks."""
    import torch
    from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, TensorDataset

    teacher = torch.randn(64, 10, generator=torch.Generator().manual_seed(0))
    x = torch.randn(steps * BATCH, 64, generator=torch.Generator().manual_seed(1 + rank))
    y = (x @ teacher).argmax(dim=1)
    dataset = TensorDataset(x, y)

    def fetch(batch: Any) -> Any:
        if input_spin_ms:
            spin(input_spin_ms)
        return batch

    # Whole batches by index (one gather per tensor), as a fast in-memory pipeline would do.
    batches = BatchSampler(SequentialSampler(dataset), BATCH, drop_last=True)
    loader = DataLoader(dataset, batch_size=None, sampler=batches, collate_fn=fetch)
    torch.manual_seed(0)
    return demo_model(), loader


def demo_model() -> Any:
    """The demo's small MLP (64 -> 256 -> 256 -> 10)."""
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
