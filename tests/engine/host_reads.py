"""A counter of host reads: every way a step can make the host wait for tensor data, or a shape wait for it.

`HostReads()` as a context counts, inside it, the Tensor methods that copy data to Python or numpy (`.item`,
`.tolist`, `.cpu`, `.numpy`, `__array__`, `bool()`, `int()`, `float()`, `__index__`) and the aten ops whose output
shape depends on the data (`nonzero`, `masked_select`, `unique`, boolean-mask indexing, tensor-count
`repeat_interleave`, `bincount`, and a scalar read from inside an op). A read made from inside another counted read
is not counted twice. `events` lists what was seen, for a failing assertion to show.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

READS = {"item", "tolist", "cpu", "numpy", "__array__", "__bool__", "__int__", "__float__", "__index__"}
DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                  "bincount", "_local_scalar_dense", "argwhere", "nonzero_static"}


class _Functions(TorchFunctionMode):
    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS and not self.owner.depth:
            self.owner.events.append(name)
            self.owner.depth += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.owner.depth -= 1
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __init__(self, owner):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.owner.depth:
            data_dependent = name in DATA_DEPENDENT or (name == "repeat_interleave" and isinstance(args[0],
                                                                                                  torch.Tensor)
                                                        and len(args) == 1)
            if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                       for i in (args[1] if len(args) > 1 else ()) if i is not None):
                data_dependent = True
            if data_dependent:
                self.owner.events.append(f"aten.{name}")
        return func(*args, **(kwargs or {}))


class HostReads:
    def __init__(self):
        self.events: list[str] = []
        self.depth = 0
        self._modes = (_Functions(self), _Ops(self))

    def __enter__(self) -> HostReads:
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)

    @property
    def count(self) -> int:
        return len(self.events)
