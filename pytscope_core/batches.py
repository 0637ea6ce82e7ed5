"""What each rank trains on, cheaply: a fingerprint of its batches.

A fingerprint is the first tensor's shape and a few values sampled at fixed, spread positions. On the hot
path it is only a small copy (a numpy fancy index on CPU, one small device tensor elsewhere: no device
sync); `resolve_fingerprints` hashes a window of them at the gather, with at most one device-to-host copy.
Ranks of a data-parallel job whose fingerprints are equal saw the same data (`DATA.DUPLICATE_SHARDS`).
Batches and model outputs are the user's objects: an attribute read that raises anything (a dict-like
output whose `__getattr__` raises KeyError for a missing key) means the attribute is not there.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

SAMPLES = 8  # values per fingerprint: enough that different data never agree by chance
_POSITIONS: dict[int, np.ndarray] = {}  # numel -> sampled flat positions (cached: the hot path reuses them)
_DEVICE_POSITIONS: dict[tuple[int, Any], Any] = {}  # (numel, device) -> the same, as a tensor on that device
_HASH_BITS = 48  # fits a float64 column exactly


def first_tensor(obj: Any, accept: Callable[[Any], bool] | None = None) -> Any:
    """The first tensor (that `accept`s, when given) in a tensor, sequence or mapping, searched three levels
    deep and four items wide, else None."""
    found = tensors(obj, 1, accept)
    return found[0] if found else None


def tensors(obj: Any, limit: int, accept: Callable[[Any], bool] | None = None, _depth: int = 0) -> list[Any]:
    """Up to `limit` tensors (that `accept`, when given) in a tensor, sequence or mapping (a dict, or one
    like transformers' `BatchEncoding`), in order, searched three levels deep and four items wide."""
    try:
        if getattr(obj, "shape", None) is not None and hasattr(obj, "dtype"):  # a tensor, an array
            return [obj] if accept is None or accept(obj) else []
    except Exception:  # a `__getattr__` that raises (a dict-like's KeyError): no such attribute, searched on
        pass
    found: list[Any] = []
    if _depth < 3:
        values = (
            obj.values()
            if isinstance(obj, (dict, Mapping))
            else obj[:4]
            if isinstance(obj, (list, tuple))
            else ()
        )
        for value in values:
            found += tensors(value, limit - len(found), accept, _depth + 1)
            if len(found) >= limit:
                break
    return found


def batch_tensor(batch: Any) -> Any:
    """The tensor that stands for a batch held in a mapping or a nested sequence: of its first four tensors,
    the first whose leading dimension is the one most of them share, the batch size (a mask or a table
    listed first, whose leading dimension is something else, is passed over); None without a tensor."""
    found = tensors(batch, 4)
    if len(found) < 2:
        return found[0] if found else None
    leads = [t.shape[0] if len(t.shape) else None for t in found]
    return found[leads.index(max(leads, key=leads.count))]  # (max: the first of the most common)


def batch_fingerprint(t: Any, batch: Any) -> Any:
    """The `fingerprint` of `t`, what the batch's size was read from, where it is a tensor or an array (not,
    say, a data frame's rows), else of the batch's tensor (`batch_tensor`)."""
    try:
        array = hasattr(t, "dtype")
    except Exception:  # a `__getattr__` that raises: not an array
        array = False
    return fingerprint(t if array else batch_tensor(batch))


def fingerprint(tensor: Any) -> Any:
    """A few values of `tensor` at fixed spread positions, with its shape; None when there is no tensor.

    CPU tensors give a numpy copy; other devices a small tensor left on the device until the gather."""
    if tensor is None:
        return None
    if isinstance(tensor, np.ndarray):  # a loader that yields numpy arrays
        if tensor.size == 0 or tensor.dtype.hasobject:
            return None
        return tensor.shape, tensor.reshape(-1)[_positions(tensor.size)]
    try:
        countable = hasattr(tensor, "numel")
    except Exception:  # (a `__getattr__` that raises: not a tensor)
        countable = False
    if not countable:  # another array type: no fingerprint
        return None
    n = int(tensor.numel())
    if n == 0:
        return None
    positions = _positions(n)
    if tensor.device.type == "cpu":
        try:  # numpy's indexing costs a fraction of torch's per-call dispatch
            return tensor.shape, tensor.numpy().reshape(-1)[positions]
        except (TypeError, RuntimeError):  # needs grad, or a dtype numpy lacks (bf16): torch's path below
            pass
    flat = tensor.detach().reshape(-1)
    return tensor.shape, flat[_device_positions(n, flat.device, positions)].float()


def _positions(n: int) -> np.ndarray:
    positions = _POSITIONS.get(n)
    if positions is None:
        positions = _POSITIONS.setdefault(n, np.linspace(0, n - 1, SAMPLES).astype(np.int64))
    return positions


def _device_positions(n: int, device: Any, positions: np.ndarray) -> Any:
    """`positions` as a tensor on `device`, made once per size and device. The copy is asynchronous (a
    blocking host-to-device copy would wait for every kernel queued before it); the numpy array it reads
    stays alive in `_POSITIONS`."""
    key = (n, device)
    found = _DEVICE_POSITIONS.get(key)
    if found is None:
        import torch

        found = _DEVICE_POSITIONS.setdefault(key, torch.from_numpy(positions).to(device, non_blocking=True))
    return found


def resolve_fingerprints(prints: list[Any]) -> list[float]:
    """Each fingerprint as a 48-bit hash in a float (NaN where there was none): one copy for device ones."""
    out = [math.nan] * len(prints)
    device = [(i, p) for i, p in enumerate(prints) if p is not None and not isinstance(p[1], np.ndarray)]
    host = {i: p[1] for i, p in enumerate(prints) if p is not None and isinstance(p[1], np.ndarray)}
    if device:
        import torch

        values = torch.stack([p[1] for _, p in device]).cpu().numpy()
        host.update({i: values[k] for k, (i, _) in enumerate(device)})
    for i, values in host.items():
        shape = prints[i][0]
        digest = hashlib.blake2b(
            repr(tuple(shape)).encode() + np.ascontiguousarray(values).tobytes(), digest_size=8
        )
        out[i] = float(int.from_bytes(digest.digest(), "little") >> (64 - _HASH_BITS))
    return out
