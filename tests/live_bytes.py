"""The peak of the bytes a block of code allocates and keeps alive, on the CPU, counted op by op: for the load tests
of ``model.parallel = "fsdp"`` (tests/test_distributed_fsdp_load.py), where each gloo rank's "device" is the host.

:class:`LiveBytes` is a ``TorchDispatchMode``: after every op it records each new storage among the op's outputs
(by a weak reference to the storage itself, so views and ``nn.Parameter`` wrappers sharing it count once and keep
it counted) and sums the storages still alive; the peak is the largest sum seen at an op boundary. Storages made
before the block, on ``meta``, or outside the dispatcher (a file mapped by safetensors) are not counted. A
measurement, not a timing: the same code gives the same figure."""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    @property
    def live(self) -> int:
        for key in [k for k, (ref, _) in self._storages.items() if ref.expired()]:
            del self._storages[key]
        return sum(size for _, size in self._storages.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or is_traceable_wrapper_subclass(tensor):
                continue
            if tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            known = self._storages.get(key)
            if storage.nbytes() and (known is None or known[0].expired()):
                self._storages[key] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out
