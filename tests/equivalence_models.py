"""Models, losses, batches and step functions for the equivalence tests, at module level so that the
spawned workers (and `pytscope equivalence MODULE:FN`) can import them."""

import torch
import torch.nn.functional as F
from torch import nn

MICRO_BATCHES = 4  # not the world size, so a missing division is told apart from a world-size scaling


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def mlp_batchnorm():
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))


def mlp_sync_batchnorm():
    return nn.SyncBatchNorm.convert_sync_batchnorm(mlp_batchnorm())


def regression_batch(n=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    # Rank-dependent data: the second half of the samples is shifted, so per-rank BatchNorm statistics differ.
    x = torch.randn(n, 8, generator=g) + torch.arange(n).remainder(2).unsqueeze(1) * 2.0
    return x, torch.randn(n, 4, generator=g)


def classification_batch(n=32, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)


def mse(output, target):
    return F.mse_loss(output, target)


def loss_of_model_and_batch(model, batch):  # not a loss_fn(outputs, targets): fails in the reference run
    inputs, targets = batch
    return mse(model(inputs), targets)


def mse_times_world_size(output, target):
    import torch.distributed as dist

    # The bug as written in real jobs: 1 in the single-process reference, W on the ranks.
    return F.mse_loss(output, target) * (dist.get_world_size() if dist.is_initialized() else 1)


def mse_summed(output, target):
    return F.mse_loss(output, target, reduction="sum")


def cross_entropy(output, target):
    return F.cross_entropy(output, target)


def _accumulate(model, loss_fn, inputs, targets, divide):
    xs, ys = inputs.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES)
    for i, (x, y) in enumerate(zip(xs, ys, strict=True)):
        loss = loss_fn(model(x), y)
        if divide:
            loss = loss / MICRO_BATCHES
        if i < MICRO_BATCHES - 1:
            with model.no_sync():  # only the last micro-batch's backward all-reduces
                loss.backward()
        else:
            loss.backward()


def accumulate_divided(model, loss_fn, inputs, targets):
    _accumulate(model, loss_fn, inputs, targets, divide=True)


def accumulate_undivided(model, loss_fn, inputs, targets):
    _accumulate(model, loss_fn, inputs, targets, divide=False)


def adam(params):
    return torch.optim.Adam(params, lr=1e-2)


def fails_on_rank_1():
    return _FailsOnRank1()


class _FailsOnRank1(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x):
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("rank 1 cannot do this")
        return self.linear(x)


def not_a_pair():
    return torch.randn(4, 8)


def hangs_in_workers():
    return _HangsInWorkers()


class _HangsInWorkers(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x):
        import time

        import torch.distributed as dist

        if dist.is_initialized():  # every rank: no collective times out first, only the caller's deadline
            time.sleep(3600)
        return self.linear(x)
