"""A small Lightning fit with ScopeCallback, run as its own process by tests/test_lightning.py.

Lightning's `ddp` strategy launches the other ranks by re-running this script, which is why the tests run it
with `subprocess` instead of building the Trainer inside pytest. Flags switch on the situations the tests
check (a busy-waiting rank, uneven shards, a user comm hook, accumulation, checkpoints and resume); rank 0
writes what the trainer saw to `--result` so the tests can compare it with the run directory.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, TQDMProgressBar
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

from pytscope_lightning import ScopeCallback


def spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1e3
    while time.perf_counter() < end:
        pass


class Job(pl.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        hidden = [
            m for _ in range(args.depth) for m in (torch.nn.Linear(args.width, args.width), torch.nn.ReLU())
        ]
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, args.width), torch.nn.ReLU(), *hidden, torch.nn.Linear(args.width, 8)
        )
        gen = torch.Generator().manual_seed(0)
        self.teacher = torch.randn(32, 8, generator=gen)
        self.automatic_optimization = not args.manual
        if args.flops_per_batch:
            self.flops_per_batch = args.flops_per_batch

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        x, y = batch
        last_rank = self.global_rank == self.trainer.world_size - 1
        if self.args.work_ms:
            spin(self.args.work_ms)
        if self.args.spin_ms and last_rank:
            spin(self.args.spin_ms)
        if (
            self.args.block_at
            and last_rank
            and self.trainer.world_size > 1
            and self.global_step == self.args.block_at
        ):
            spin(3600e3)  # never reaches this step's all-reduce
        if self.args.raise_at and self.global_step == self.args.raise_at:
            raise (
                KeyboardInterrupt("injected interrupt")
                if self.args.interrupt
                else RuntimeError("injected error")
            )
        loss = F.cross_entropy(self.net(x), y)
        if self.args.sync_dist:
            self.log("synced_loss", loss, sync_dist=True)  # an all-reduce inside the step's forward
        if self.args.inf_from and self.global_step >= self.args.inf_from:
            loss = loss * float("inf")  # what TensorBoard shows at this global_step
        if self.args.guard_from and self.global_step >= self.args.guard_from:
            loss = loss * float("nan")
            if not torch.isfinite(loss):
                return None  # a NaN guard: Lightning skips the batch (and still calls optimizer.step)
        if self.args.manual:
            return self._manual_step(loss, x, y)
        return {"loss": loss} if self.args.dict_output else loss

    def configure_gradient_clipping(self, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        spin(self.args.clip_ms)  # Lightning's clipping runs after on_before_optimizer_step
        super().configure_gradient_clipping(optimizer, *args, **kwargs)

    def on_train_batch_end(self, *args: Any) -> None:
        last_rank = self.global_rank == self.trainer.world_size - 1
        if self.args.late_spin_ms and last_rank:
            spin(self.args.late_spin_ms)  # after the gradient all-reduce: the others wait at the next batch
        if self.args.block_after_at and last_rank and self.global_step == self.args.block_after_at:
            spin(3600e3)  # after the optimizer step: the others wait in the broadcast at the next batch's top

    def _manual_step(self, loss: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # Two optimizers, each with a forward and backward of its own over the batch, as a GAN's generator
        # and discriminator: Lightning's global_step advances by two per batch, its loggers' step by one.
        first, second = self.optimizers()  # type: ignore[misc]
        first.zero_grad()
        self.manual_backward(loss)
        first.step()
        second.zero_grad()
        self.manual_backward(F.cross_entropy(self.net(x), y))
        second.step()
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def on_validation_end(self) -> None:
        spin(self.args.slow_ends_ms)  # the module's hook runs after the callbacks' on_validation_end

    def configure_optimizers(self) -> Any:
        if self.args.manual:
            params = list(self.net.parameters())
            half = len(params) // 2
            return [torch.optim.SGD(params[:half], lr=0.05), torch.optim.SGD(params[half:], lr=0.05)]
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        if self.args.slow_ends_ms:
            state_dict = optimizer.state_dict

            def slow_state_dict() -> dict[str, Any]:  # read by a checkpoint before on_save_checkpoint runs
                spin(self.args.slow_ends_ms)
                return state_dict()

            optimizer.state_dict = slow_state_dict  # type: ignore[method-assign]
        return optimizer

    def _data(self, samples: int, seed: int) -> TensorDataset:
        x = torch.randn(samples, 32, generator=torch.Generator().manual_seed(seed))
        return TensorDataset(x, (x @ self.teacher).argmax(dim=1))

    def train_dataloader(self) -> DataLoader:
        rank, world = self.trainer.global_rank, self.trainer.world_size
        batches = self.args.batches_per_epoch
        if self.args.same_data:  # use_distributed_sampler=False and no shard of its own: every rank alike
            return DataLoader(self._data(batches * self.args.batch, seed=1), batch_size=self.args.batch)
        if self.args.uneven:
            # use_distributed_sampler=False: each rank builds its own shard, the last one a batch longer.
            batches += 1 if rank == world - 1 else 0
            return DataLoader(
                self._data(batches * self.args.batch, seed=rank + 1), batch_size=self.args.batch, shuffle=True
            )
        return DataLoader(
            self._data(batches * self.args.batch * world, seed=1), batch_size=self.args.batch, shuffle=True
        )

    def val_dataloader(self) -> DataLoader:
        SlowStartLoader.start_ms = self.args.slow_ends_ms
        return SlowStartLoader(self._data(4 * self.args.batch, seed=99), batch_size=self.args.batch)


class FetchingJob(Job):
    """`training_step(self, dataloader_iter)`: the step fetches its own batch."""

    def training_step(self, dataloader_iter: Any) -> Any:  # type: ignore[override]
        batch, batch_idx, _ = next(dataloader_iter)
        return super().training_step(batch, batch_idx)


class SlowStartLoader(DataLoader):
    """A loader whose iteration takes time to start, as one whose workers start: Lightning starts the
    validation loader before any validation hook."""

    start_ms = 0.0

    def __iter__(self) -> Any:
        spin(self.start_ms)
        return super().__iter__()


class BreakScope(pl.Callback):
    """Makes the scope's data mark raise from step 10 on: the fit must go on with the scope disabled."""

    def __init__(self, scope_callback: ScopeCallback) -> None:
        self.scope_callback = scope_callback

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int
    ) -> None:
        scope = self.scope_callback.scope
        if trainer.global_step == 10 and scope is not None:
            scope.hooks.note_batch = _boom  # type: ignore[method-assign]


def _boom(batch: Any) -> None:
    raise RuntimeError("injected failure")


class SlowCallback(pl.Callback):
    """Another callback's work after each batch (listed after ScopeCallback, as Lightning's own are)."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def on_train_batch_end(self, *args: Any) -> None:
        spin(self.ms)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--run-dir", required=True)
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--strategy", default="auto", choices=["auto", "ddp", "ddp_spawn"])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--interval", type=int, default=50)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=0, help="hidden width x width layers (compute per sample)")
    p.add_argument("--batches-per-epoch", type=int, default=1000)
    p.add_argument(
        "--work-ms", type=float, default=0.0, help="busy-wait on every rank in every training_step"
    )
    p.add_argument(
        "--spin-ms", type=float, default=0.0, help="busy-wait on the last rank in every training_step"
    )
    p.add_argument("--uneven", action="store_true")
    p.add_argument(
        "--same-data", action="store_true", help="no DistributedSampler: every rank the same batches"
    )
    p.add_argument("--block-at", type=int, default=0, help="the last rank blocks forever at this step")
    p.add_argument(
        "--block-after-at", type=int, default=0, help="the last rank blocks forever once global_step is this"
    )
    p.add_argument("--hang-timeout", type=float, default=None)
    p.add_argument("--accumulate", type=int, default=1)
    p.add_argument("--comm-hook", choices=["fp16"], default=None)
    p.add_argument("--val-every", type=int, default=0, help="validate every N batches (0: never)")
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--ckpt-path", default=None, help="resume from this checkpoint")
    p.add_argument("--csv-dir", default=None)
    p.add_argument("--dict-output", action="store_true")
    p.add_argument("--result", default=None)
    p.add_argument("--break-scope", action="store_true")
    p.add_argument("--callback-ms", type=float, default=0.0, help="a later callback's work after each batch")
    p.add_argument("--sanity-steps", type=int, default=0, help="Lightning's validation sanity check")
    p.add_argument("--clip-ms", type=float, default=0.0, help="gradient clipping takes this long per step")
    p.add_argument("--late-spin-ms", type=float, default=0.0, help="the last rank's work after each batch")
    p.add_argument("--sync-dist", action="store_true", help="training_step logs its loss with sync_dist=True")
    p.add_argument("--raise-at", type=int, default=0, help="training_step raises at this global step")
    p.add_argument("--interrupt", action="store_true", help="--raise-at raises KeyboardInterrupt")
    p.add_argument("--inf-from", type=int, default=0, help="the loss is infinite from this global step on")
    p.add_argument(
        "--guard-from",
        type=int,
        default=0,
        help="the loss is NaN from this global step on; the step returns None",
    )
    p.add_argument("--manual", action="store_true", help="manual optimization with two optimizers")
    p.add_argument("--fits", type=int, default=1, help="fit this many times with the same callback")
    p.add_argument(
        "--refit-from",
        default=None,
        help="then fit a new trainer with the same callback from this checkpoint",
    )
    p.add_argument("--refit-steps", type=int, default=0, help="that fit's max_steps")
    p.add_argument("--refit-to", type=int, default=0, help="then fit the same trainer again, to this step")
    p.add_argument("--validate-first", default=None, help="trainer.validate(ckpt_path=this) before the fit")
    p.add_argument(
        "--slow-ends-ms",
        type=float,
        default=0.0,
        help="the validation loader's start, the module's on_validation_end and the optimizer's "
        "state_dict (read by checkpoints) take this long",
    )
    p.add_argument("--fast-dev-run", action="store_true")
    p.add_argument("--dataloader-iter", action="store_true", help="training_step fetches its own batches")
    p.add_argument("--progress-bar", choices=["none", "rich", "tqdm"], default="none")
    p.add_argument("--flops-per-step", type=float, default=None)
    p.add_argument("--peak-flops", type=float, default=None)
    p.add_argument(
        "--flops-per-batch", type=float, default=None, help="set on the module, as for ThroughputMonitor"
    )
    p.add_argument(
        "--compile",
        default=None,
        help="fit torch.compile(module, backend=this, fullgraph=True) (e.g. aot_eager)",
    )
    args = p.parse_args()

    torch.set_num_threads(1)
    strategy: Any = args.strategy
    if args.comm_hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        strategy = DDPStrategy(ddp_comm_hook=default_hooks.fp16_compress_hook)
    callbacks: list[Any] = [
        ScopeCallback(
            run_dir=args.run_dir,
            interval=args.interval,
            console=True,
            hang_timeout=args.hang_timeout or "auto",
            flops_per_step=args.flops_per_step,
            peak_flops=args.peak_flops,
        )
    ]
    if args.progress_bar != "none":
        callbacks.append(RichProgressBar() if args.progress_bar == "rich" else TQDMProgressBar())
    if args.break_scope:
        callbacks.append(BreakScope(callbacks[0]))
    if args.callback_ms:
        callbacks.append(SlowCallback(args.callback_ms))
    if args.ckpt_every:
        callbacks.append(
            ModelCheckpoint(dirpath=args.ckpt_dir, every_n_train_steps=args.ckpt_every, save_top_k=-1)
        )

    def make_trainer(max_steps: int) -> pl.Trainer:
        return pl.Trainer(
            accelerator="cpu",
            devices=args.devices,
            strategy=strategy,
            max_steps=max_steps,
            fast_dev_run=args.fast_dev_run,
            accumulate_grad_batches=args.accumulate,
            callbacks=callbacks,
            logger=CSVLogger(args.csv_dir, name="", version="") if args.csv_dir else False,
            log_every_n_steps=10,
            enable_checkpointing=bool(args.ckpt_every),
            enable_progress_bar=args.progress_bar != "none",
            enable_model_summary=False,
            use_distributed_sampler=not (args.uneven or args.same_data),
            val_check_interval=args.val_every or None,
            limit_val_batches=2 if args.val_every else 0,
            num_sanity_val_steps=args.sanity_steps,
        )

    trainer = make_trainer(args.steps)
    result: dict[str, Any] = {}
    module: Any = FetchingJob(args) if args.dataloader_iter else Job(args)
    if args.compile:
        module = torch.compile(module, backend=args.compile, fullgraph=True)
    if args.validate_first:
        trainer.validate(module, ckpt_path=args.validate_first)
    try:
        trainer.fit(module, ckpt_path=args.ckpt_path)
    except (RuntimeError, KeyboardInterrupt) as exc:  # a notebook or sweep driver catching the failure
        result["caught"] = f"{type(exc).__name__}: {exc}"
        time.sleep(args.hang_timeout * 3 if args.hang_timeout else 0)  # a watchdog left behind would fire
    if args.refit_to:
        trainer.fit_loop.epoch_loop.max_steps = args.refit_to  # train on: the same trainer, a second fit
        trainer.fit(module)
    for _ in range(args.fits - 1):
        trainer = make_trainer(args.steps)  # a new trainer with the same callback: a new run
        trainer.fit(Job(args))
    if args.refit_from:
        trainer = make_trainer(args.refit_steps)  # a new trainer resuming a checkpoint: the same run
        trainer.fit(Job(args), ckpt_path=args.refit_from)
    if args.result and trainer.is_global_zero:
        result.update(
            global_step=trainer.global_step,
            world_size=trainer.world_size,
            trainer_as_it_was="save_checkpoint" not in trainer.__dict__  # the scope's wrappers are gone
            and "run" not in trainer.fit_loop.epoch_loop.val_loop.__dict__
            and not {"reduce", "barrier"} & set(trainer.strategy.__dict__)
            and "_broadcast_sigterm_tensor" not in trainer.fit_loop.epoch_loop.__dict__
            and "_after_closure" not in trainer.strategy.precision_plugin.__dict__,
        )
        with open(args.result, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
