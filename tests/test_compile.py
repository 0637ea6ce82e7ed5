"""torch.compile: a compiled model is timed from outside the compiled code, never gets a graph break or an
error from pytscope (fullgraph=True throughout), and the wrapper it hides (DDP) is still recognised.

Every case compiles with the "aot_eager" backend: dynamo and AOTAutograd as with "inductor", without the C++
build. The 2-rank case, Accelerate's `torch.compile(DDP(model))`, is in test_accelerate.py; Lightning's
compiled LightningModule in test_lightning.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from pytscope_core import Scope
from pytscope_core.compiled import is_compiled, uncompiled
from pytscope_core.parallelism import DDP, detect
from pytscope_core.rundir import load_run
from pytscope_core.timeline import PHASES

FORWARD = PHASES.index("forward")
STEPS = 12


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test starts with nothing compiled and leaves nothing compiled (pytscope counts no FLOPs in a process
    where torch.compile has compiled anything)."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


class MLP(torch.nn.Module):
    """A user's own module: dynamo leaves torch.nn's own classes, compiled in place, to run eagerly."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(8, 32)
        self.out = torch.nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.hidden(x)))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return MLP()


def train(model: Any, opt: Any, scope: Scope | None = None, step: Any = None) -> None:
    """No loader: each step opens at the forward, the mark the compiler could hide. `step`: opt.step, or a
    compiled one."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 2, (16,), generator=gen)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        (step or opt.step)()
        opt.zero_grad()
        if scope is not None:
            scope.log(loss=loss)


def forward_ms(run_dir: Path) -> np.ndarray:
    return load_run(run_dir).arrays.phases[:, 0, FORWARD]


@pytest.mark.parametrize("how", ["torch.compile", "compile in place", "compile in place after watch"])
def test_a_compiled_model_is_timed_outside_the_compiled_code(tmp_path: Path, how: str) -> None:
    inner = mlp()
    model: Any = inner
    if how == "torch.compile":
        model = torch.compile(inner, backend="aot_eager", fullgraph=True)
    elif how == "compile in place":
        inner.compile(backend="aot_eager", fullgraph=True)
    before = dict(model.__dict__)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=5)
    opt = torch.optim.SGD(inner.parameters(), lr=0.01)
    scope.watch(model, opt)
    if how == "compile in place after watch":
        inner.compile(backend="aot_eager", fullgraph=True)
        before["_compiled_call_impl"] = inner._compiled_call_impl
    train(model, opt, scope)
    scope.finish()

    assert scope.errors == [] and dict(counters["graph_break"]) == {}
    assert counters["stats"]["unique_graphs"] >= 1  # the model did run compiled
    # Compiled in place after watch, the first forward ran (and compiled) unseen; from the second step on, the
    # compiled call itself is wrapped.
    timed = forward_ms(tmp_path)[1:] if how.endswith("after watch") else forward_ms(tmp_path)
    assert timed.size >= STEPS - 2 and (timed > 0).all()
    assert load_run(tmp_path).context.flops_per_step is None  # no FLOP counter around compiled code
    assert {k: v for k, v in model.__dict__.items() if k in before} == before  # every wrapper taken off again
    assert "forward" not in inner.__dict__ or how == "torch.compile"


def test_a_compiled_optimizer_step_is_timed_and_the_flop_count_ends_outside_it(tmp_path: Path) -> None:
    # The hooks run inside the compiled step through a graph break (torch itself compiles an optimizer step
    # only with fullgraph=False). The FLOP counter must not be left inside the compiled step: that broke the
    # next eager op ("Hit Python dispatch key but no arguments had PyInterpreter"). With warmup=2 it counts
    # step 1, before anything is compiled (later, anything compiled keeps it off).
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=5, warmup=2)
    scope.watch(model, opt)
    train(model, opt, step=torch.compile(opt.step, backend="aot_eager"))
    scope.finish()
    run = load_run(tmp_path)
    assert scope.errors == [] and run.arrays.n_steps == STEPS
    assert (run.arrays.phases[:, 0, PHASES.index("optimizer")] > 0).all()
    # Linear(8,32) and Linear(32,2) on 16 samples: the forward, the weights' gradients (as many), and the
    # second layer's input gradient (the first layer's input needs none); Adam adds no matrix product
    forward = 2 * 16 * (8 * 32 + 32 * 2)
    assert run.context.flops_per_step == 2 * forward + 2 * 16 * 32 * 2


def test_a_model_compiled_into_a_new_module_after_watch_is_named_and_training_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=5)
    scope.watch(model, opt)
    train(torch.compile(model, backend="aot_eager", fullgraph=True), opt)  # the user trains the new module
    scope.finish()
    assert dict(counters["graph_break"]) == {} and scope.errors == []  # a limit of the measurement, said once
    assert capsys.readouterr().err.count("watch the model torch.compile returned") == 1


def test_compiled_wrappers_are_seen_through() -> None:
    model = mlp()
    assert not is_compiled(model) and uncompiled(model) is model
    wrapped = torch.compile(model, backend="aot_eager")
    assert uncompiled(wrapped) is model and is_compiled(wrapped)
    block: Any = torch.compile(mlp(), backend="aot_eager")
    regional = torch.nn.Sequential(block, torch.nn.ReLU())
    assert is_compiled(regional)  # a compiled block inside: the FLOP counter stays off for it too
    lightning_style = mlp()
    lightning_style.forward = torch.compile(lightning_style.forward, backend="aot_eager")
    assert is_compiled(lightning_style)


def test_a_compiled_ddp_model_is_ddp(tmp_path: Path, one_rank_group: None) -> None:
    ddp = torch.nn.parallel.DistributedDataParallel(mlp())
    compiled = torch.compile(ddp, backend="aot_eager")
    assert detect(compiled, 1).name == DDP
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=5)
    scope.watch(compiled, opt)
    train(compiled, opt, scope)
    scope.finish()
    run = load_run(tmp_path)
    assert scope.errors == [] and run.context.parallelism == DDP
    assert (
        run.arrays.grad_syncs == 1
    ).all()  # each backward's all-reduce seen: DDP's flag read through the wrapper


@pytest.mark.parametrize("compiled", ["blocks", "root"])
def test_fsdp2_units_compiled_in_place_with_fullgraph_train_and_are_timed(
    tmp_path: Path, one_rank_group: None, compiled: str
) -> None:
    # FSDP2's hooks, and pytscope's beside them, run inside a unit's compiled call: pytscope's step aside there
    # (that unit's all-gathers and reduce-scatters go untimed). A root compiled in place is timed around its
    # compiled call instead.
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(8, 2))
    fully_shard(model[0])
    fully_shard(model[1])
    fully_shard(model)
    for unit in [model[0], model[1]] if compiled == "blocks" else [model]:
        unit.compile(backend="aot_eager", fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = Scope(tmp_path, console=False, hang_timeout=None, interval=5)
    scope.watch(model, opt)
    train(model, opt, scope)
    scope.finish()
    assert scope.errors == [] and dict(counters["graph_break"]) == {}
    assert (forward_ms(tmp_path) > 0).all() and load_run(tmp_path).arrays.n_steps == STEPS
