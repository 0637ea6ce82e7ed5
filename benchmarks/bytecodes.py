"""How much Python pytscope runs per training step: calls and bytecodes in its own code, per function.

The 1 ms MLP step of benchmarks/overhead.py (batch 32, 64-384-384-10, one thread) with model, optimizer and
loader watched by the torch-level `Scope` and `interval` beyond the run (no gather: the per-step path alone),
traced with `sys.settrace` and opcode events. Exact and the same on every run, unlike a timing; it says how
much code the hooks run, not what that costs (for that: overhead.py and instructions.py).

    python benchmarks/bytecodes.py [--steps 200]

A few seconds.
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import overhead  # noqa: E402  (its model, loader and step)

PACKAGE = str(Path(__file__).resolve().parents[1] / "pytscope_core")
WARM_STEPS = 30


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="steps traced")
    args = p.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from pytscope_core.scope import Scope

    torch.set_num_threads(1)
    model = overhead.make_model(384)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = overhead.make_loader(32, args.steps + WARM_STEPS)
    with tempfile.TemporaryDirectory() as run_dir:
        scope = Scope(run_dir, interval=10**9, console=False, hang_timeout=None)
        scope.watch(model, opt, loader)
        batches = iter(loader)

        def step() -> None:
            x, y = next(batches)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            scope.log(loss=loss)

        for _ in range(WARM_STEPS):  # past the FLOP count and the first gather's set-up
            step()
        ops: collections.Counter[str] = collections.Counter()
        calls: collections.Counter[str] = collections.Counter()

        def trace(frame: FrameType, event: str, arg: Any) -> Any:
            code = frame.f_code
            if not code.co_filename.startswith(PACKAGE):
                return None
            if event == "call":
                calls[code.co_qualname] += 1
                frame.f_trace_opcodes = True
            elif event == "opcode":
                ops[code.co_qualname] += 1
            return trace

        sys.settrace(trace)
        try:
            for _ in range(args.steps):
                step()
        finally:
            sys.settrace(None)
        scope.finish()
    n = args.steps
    print(
        f"per step in pytscope's code: {sum(calls.values()) / n:.1f} Python calls, {sum(ops.values()) / n:.0f} bytecodes"
    )
    for name, count in ops.most_common():
        print(f"  {count / n:7.1f} bytecodes  {calls[name] / n:5.2f} calls  {name}")


if __name__ == "__main__":
    main()
