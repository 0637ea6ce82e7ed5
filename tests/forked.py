"""Processes for the tests, forked from one that has imported torch, pytscope and Lightning once.

`import lightning` takes 5-7 s of a 2-core machine and `import torch` 2 s: most of what a small fit costs,
and the tests start over a hundred such processes. `multiprocessing`'s fork server imports them once and
forks every process from there: the gloo ranks of tests/ddp_worker.py and its kind (`start`), and scripts
run as from the command line (`run`). A rank writes to the test's file descriptors 1 and 2 as they are when
it starts (what `capfd` reads, and what pytest shows of a failed test). A script run so is still a process of its own: its own file
descriptors 1 and 2 (written to files), working directory, environment, exit code and at-exit handlers, so
what a test reads is what the command line gives. A multi-rank Lightning job starts its other ranks as usual
(`ddp` re-runs the script: those ranks import Lightning themselves). Tests about how a process ends
(signals, a hang) use `subprocess`.

The server's environment is the test session's when it started: a process forked from it gets its own
environment only where it is given one (`run`'s `env`, or set by the worker itself).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from pathlib import Path
from typing import Any

PRELOAD = ["torch", "torch.distributed", "pytscope_core", "lightning.pytorch", "pytscope_lightning"]
"""What the fork server imports (one missing, as Lightning where only the core is installed, is skipped)."""


def server() -> multiprocessing.context.ForkServerContext:
    """The fork server's context (started by the first process it forks)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # (once the server runs, later calls change nothing)
    return ctx


def start(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """`torch.multiprocessing.start_processes(fn, args, nprocs, join=True)`, forked from the server."""
    import torch.multiprocessing as mp

    server()
    mp.start_processes(_rank, args=(_Stdio(), fn, *args), nprocs=nprocs, start_method="forkserver", join=True)


def _rank(rank: int, stdio: None, fn: Callable[..., None], *args: Any) -> None:
    fn(rank, *args)


class _Stdio:
    """This process's file descriptors 1 and 2, handed to a process started from the fork server (which
    would otherwise write where the server's went) and made its own as it unpickles its arguments."""

    def __reduce__(self) -> tuple[Callable[..., None], tuple[Any, ...]]:
        return _adopt, (reduction.DupFd(1), reduction.DupFd(2))


def _adopt(*fds: Any) -> None:
    for fd, handed in enumerate(fds, start=1):
        os.dup2(handed.detach(), fd)


def run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)` for
    `cmd` = [python, script, *args], forked from the fork server."""
    _, script, *args = cmd
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        job = server().Process(target=_job, args=(script, args, str(cwd), env, str(out), str(err)))
        job.start()
        job.join(timeout)
        if job.exitcode is None:
            job.kill()
            job.join()
            raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(), err.read_text())
        return subprocess.CompletedProcess(cmd, job.exitcode, out.read_text(), err.read_text())


def _job(script: str, args: list[str], cwd: str, env: dict[str, str], out: str, err: str) -> None:
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    if "OMP_NUM_THREADS" in env:  # (OpenMP read the variable when the server imported torch)
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` sets it
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
