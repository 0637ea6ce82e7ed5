"""The shape of the code, checked: parts talk through public surfaces, classes stay small, docs match code."""

from __future__ import annotations

import ast
from pathlib import Path

from pytscope_core.options import ScopeOptions

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pytscope_core", "pytscope_lightning", "pytscope_accelerate")

# Private names of other libraries that pytscope relies on, each for a reason stated where it is used.
FOREIGN_PRIVATE = {
    "os._exit",  # the hang abort: exit now, without running the (hung) interpreter shutdown
    "sys._current_frames",  # every thread's stack for the hang dump
    "sys._getframe",  # who called a torch.distributed collective: the loop, or torch itself (collectives.py)
    "torch._C",  # the autograd graph task running, if any: a backward that raised has ended (backward.py)
    "grad._version",  # whether a backward wrote a gradient since the forward: none ran (backward.py)
    "dist.distributed_c10d._get_default_store",  # the job's own key-value store (heartbeats, meeting)
    "torch.autograd.Variable._execution_engine",  # the engine's final callbacks ("graph done")
    # Lightning's training loop hands these to its data fetcher around each fetch (for its profiler): the
    # callback's wait for data is marked there, the fetch itself
    "loop._on_before_fetch",
    "loop._on_after_fetch",
    # FSDP2 keeps set_requires_gradient_sync's setting on each unit's parameter groups, with no public getter:
    # read (never written) to know whether a backward reduce-scatters (fsdp.py)
    "unit._get_fsdp_state",
    "unit._get_fsdp_state()._fsdp_param_groups",
    # torch.compile's wrapper module keeps the module it compiles there, with no public getter (compiled.py)
    "model._orig_mod",
    # Lightning Fabric's wrapper keeps the module it runs (DDP, or the model) there, with no public getter
    "model._forward_module",
    "torch._dynamo",  # torch < 2.3 has `is_compiling` there only (compiled.py)
    # FLOPs counted as torch's FlopCounterMode counts them, by each op's family's formula, without the module
    # tracker that hooks the user's graph (flops.py)
    "torch._ops",
    "func._overloadpacket",
    # the step Lightning's loggers, LearningRateMonitor and DeviceStatsMonitor log at (no public getter)
    "trainer.fit_loop.epoch_loop._batches_that_stepped",
    # where Lightning's closure ends, after on_before_optimizer_step and gradient clipping: the optimizer
    # phase begins there (callback.py). Read by name, with getattr: the epoch loop's
    # `_broadcast_sigterm_tensor` (a collective of every batch, timed as one), Accelerate's `_models` (the
    # models prepare returned) and `_custom_objects` (what save_state stores)
    "plugin._after_closure",
    # torch's Join keeps its joinables' hooks there, with no public way to add one to a Join the user made:
    # the scope's join hook runs after DDP's for the duration of one join (joins.py)
    "join._join_hooks",
}


def _sources() -> list[Path]:
    return [f for pkg in PACKAGES for f in sorted((ROOT / pkg).rglob("*.py"))]


def test_no_module_reaches_into_another_objects_private_state() -> None:
    reaches = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
                continue
            if node.attr.startswith("__") or (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):
                continue
            text = ast.unparse(node)
            if text not in FOREIGN_PRIVATE:
                reaches.append(f"{path.relative_to(ROOT)}:{node.lineno}: {text}")
    assert reaches == []


def test_no_core_class_is_a_god_class() -> None:
    sizes = {
        f"{path.relative_to(ROOT)}::{node.name}": node.end_lineno - node.lineno + 1  # type: ignore[operator]
        for path in (ROOT / "pytscope_core").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
    }
    assert {name: n for name, n in sizes.items() if n > 300} == {}


def test_readme_options_table_is_the_dataclass() -> None:
    assert ScopeOptions.markdown_table() in (ROOT / "README.md").read_text()


def test_integrations_take_the_same_options() -> None:
    # One source of truth: both integrations pass their keywords to ScopeOptions, so any field works there.
    for path in (ROOT / "pytscope_lightning" / "callback.py", ROOT / "pytscope_accelerate" / "scope.py"):
        assert "**options: Any" in path.read_text(), path
