"""The two runs `check_equivalence` compares: the same training loop in this process on the whole batch, and in
W spawned gloo ranks under `DistributedDataParallel`, each on its `DistributedSampler` shard.

When a rank fails, its peers fail after it (gloo's "Connection closed by peer" in their all-reduce), and
torch's `join` reports whichever it sees first. Each rank therefore writes its error and the time to the
parent's store before it dies, and `Workers.wait` names the rank that failed first: the cause, not an echo.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np

FAILURE_KEY = "pytscope/failed/{rank}"
"""Where rank r leaves {"t": unix time, "error": last line, "traceback": text} in the parent's store."""


class WorkerError(RuntimeError):
    """A worker process failed or did not finish; the message carries its error."""


def shard(obj: Any, rank: int, world_size: int) -> Any:
    """`obj` (a tensor, or tuples, lists, dicts of them) split on dim 0 as `DistributedSampler(shuffle=False,
    drop_last=False)` splits it for rank `rank`; anything else is passed whole."""
    import torch
    from torch.utils.data import DistributedSampler

    if isinstance(obj, torch.Tensor) and obj.dim() > 0:
        # The sampler itself, so the split is exactly the one a DDP data loader makes.
        samples = cast(Any, range(obj.shape[0]))
        sampler: DistributedSampler[int] = DistributedSampler(
            samples, world_size, rank, shuffle=False, drop_last=False
        )
        return obj.index_select(0, torch.tensor(list(sampler)))
    if isinstance(obj, (tuple, list)):
        return type(obj)(shard(x, rank, world_size) for x in obj)
    if isinstance(obj, dict):
        return {k: shard(v, rank, world_size) for k, v in obj.items()}
    return obj


def train(
    model: Any,
    loss_fn: Callable[..., Any],
    step_fn: Callable[..., None],
    optimizer_factory: Callable[[Any], Any],
    inputs: Any,
    targets: Any,
    steps: int,
) -> dict[str, np.ndarray]:
    """Train mode (so BatchNorm uses batch statistics, as in training). Returns the first step's gradients
    and forward calls (`micro_batches`), and the parameters after the last step."""
    module = getattr(model, "module", model)  # DDP's wrapper prefixes names with "module."
    forward_calls = [0]

    def count(*_: Any) -> None:
        forward_calls[0] += 1

    hook = module.register_forward_pre_hook(count)
    model.train()
    optimizer = optimizer_factory(model.parameters())
    out: dict[str, np.ndarray] = {}
    for step in range(steps):
        optimizer.zero_grad()
        step_fn(model, loss_fn, inputs, targets)
        if step == 0:
            hook.remove()
            out["micro_batches"] = np.array(forward_calls[0])
            for name, p in module.named_parameters():
                grad = p.grad if p.grad is not None else p.detach().new_zeros(p.shape)
                out[f"grad/{name}"] = grad.detach().cpu().numpy().copy()
        optimizer.step()
    for name, p in module.named_parameters():
        out[f"param/{name}"] = p.detach().cpu().numpy().copy()
    return out


class Workers:
    """W spawned ranks meeting at a TCPStore this process holds, so the port is free and never raced for."""

    def __init__(self, context: Any, store: Any) -> None:
        self.context, self.store = context, store

    def wait(self, timeout_s: float) -> None:
        """Until every rank has finished; `WorkerError` naming the first rank to fail, or at the timeout."""
        import torch.multiprocessing as mp

        deadline = time.monotonic() + timeout_s
        # torch logs a warning as it ends the peers of a failed rank; the WorkerError below says it instead,
        # so that the CLI's bad-input message stays one line.
        spawn_log = logging.getLogger("torch.multiprocessing.spawn")
        level = spawn_log.level
        spawn_log.setLevel(logging.ERROR)
        try:
            while not self.context.join(timeout=max(0.0, deadline - time.monotonic())):
                if time.monotonic() >= deadline:
                    raise WorkerError(
                        f"the {len(self.context.processes)} worker processes did not finish within "
                        f"{timeout_s:g} s (a collective some rank never joined?); they were killed"
                    )
        except mp.ProcessRaisedException as exc:
            lines = [line for line in str(exc).strip().splitlines() if line.strip()]
            raise self.first_failure() or WorkerError(
                f"rank {exc.error_index} failed: {lines[-1].strip() if lines else exc}\n{exc}"
            ) from None
        except mp.ProcessExitedException as exc:
            # A rank can also die by a signal after recording its error, on its way out.
            raise self.first_failure() or WorkerError(f"rank {exc.error_index} died: {exc}") from None
        finally:
            spawn_log.setLevel(level)

    def first_failure(self) -> WorkerError | None:
        """The error of the rank that recorded its failure first; None when none could."""
        failures = []
        for rank in range(len(self.context.processes)):
            key = FAILURE_KEY.format(rank=rank)
            if self.store.check([key]):
                failures.append((json.loads(self.store.get(key)), rank))
        if not failures:
            return None
        failure, rank = min(failures, key=lambda f: f[0]["t"])
        return WorkerError(f"rank {rank} failed: {failure['error']}\n{failure['traceback']}")

    def stop(self) -> None:
        for process in self.context.processes:  # only stragglers of a failed or timed-out run are alive
            if process.is_alive():
                process.kill()
            process.join()


def start_workers(world_size: int, job: dict[str, Any], out_dir: str) -> Workers:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    # Port 0: the OS picks a free port, and this process keeps it bound for the whole run.
    store = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=job["timeout_s"]),
    )
    job = dict(job, port=store.port, out_dir=out_dir, world_size=world_size)
    context = mp.start_processes(_worker, args=(job,), nprocs=world_size, join=False, start_method="spawn")
    return Workers(context, store)


def read_results(out_dir: str) -> dict[str, np.ndarray]:
    """What rank 0 wrote: its first gradients and last parameters (`train`'s arrays)."""
    path = Path(out_dir) / "rank0.npz"
    if not path.exists():
        raise WorkerError(f"the workers finished without writing their results ({path.name})")
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def _worker(rank: int, job: dict[str, Any]) -> None:
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=job["timeout_s"])
    store = dist.TCPStore("127.0.0.1", job["port"], is_master=False, timeout=timeout)
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=job["world_size"], timeout=timeout)
        _train_rank(rank, job)
    except BaseException as exc:
        # Recorded before this rank's gloo connections close: its peers' errors come after, and later.
        error = traceback.format_exception_only(type(exc), exc)[-1].strip()
        failure = dict(t=time.time(), error=error, traceback=traceback.format_exc())
        store.set(FAILURE_KEY.format(rank=rank), json.dumps(failure))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The work is done and rank 0's results are on disk: leave without the interpreter's shutdown. In it, about
    # one run in 100 here aborted in C++ after everything had succeeded (SIGABRT, "terminate called without an
    # active exception", no Python frame left on the stack), which the caller could only report as a dead rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _train_rank(rank: int, job: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)  # W ranks share the machine; one thread each keeps the runs comparable
    world_size = job["world_size"]
    torch.manual_seed(job["seed"])
    model = job["model_factory"]()
    model.load_state_dict(job["state_dict"])
    ddp = DistributedDataParallel(model)
    inputs, targets = shard(job["inputs"], rank, world_size), shard(job["targets"], rank, world_size)
    torch.manual_seed(job["seed"])
    out = train(ddp, job["loss_fn"], job["step_fn"], job["optimizer_factory"], inputs, targets, job["steps"])
    if rank == 0:  # DDP keeps the ranks' gradients and parameters identical; rank 0 speaks for all
        np.savez(Path(job["out_dir"]) / "rank0.npz", allow_pickle=False, **out)
    # A rank that tears gloo down while its peer is still in a collective aborts the peer (SIGABRT, seen
    # here about one run in three): leave together. A failed rank skips this; the caller kills.
    dist.barrier()
