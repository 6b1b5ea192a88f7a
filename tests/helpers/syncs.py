"""Counting the operations that make the host wait for a device, on any device, the CPU included.

On a GPU, reading a value the device computed (``item()``, ``int(t)``, ``bool(t)``,
``tolist()``), an operation whose output size depends on the data (``nonzero``, boolean-mask
indexing, ``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``,
``bincount``) or a copy to host memory makes the host wait until the device has run
everything queued before it: the host can no longer run ahead and issue the next work, and
overlap is lost. ``SyncCounter`` counts them, as a ``TorchDispatchMode`` that sees every aten
operation of the thread that enters it, plus the few ``Tensor`` methods that read values
without one (``tolist``, ``numpy``, ``cpu``).

Which tensors are the device's: on an accelerator, those that are not on the CPU. On CPU, where
every tensor is, the counter follows where they *would* be (``tainted``): what
``freescale.device.to_device`` made (its CPU form is an ``aten.alias``), the parameters and
buffers of the ``modules`` given, and everything computed from any of those. What the code
keeps on the host (a batch's lengths, the routes, the masks) stays untainted, so reading it is
free, as it is on a GPU.

``events`` holds ("sync", what) in order (on a GPU also ("library sync", what) for those inside
fbgemm, TorchRec or torchft); a caller may put markers of its own between them (e.g. a
timeline's ("open", "forward")) to see where each happened.
"""

from __future__ import annotations

import os
import threading
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

_ALWAYS = {
    aten._local_scalar_dense.default: "read a value (item/int/bool/float)",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique_consecutive",
    aten.bincount.default: "bincount",
    aten.equal.default: "equal",
}
_MASK_INDEXED = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_TAINT = "_freescale_on_device"


class SyncCounter(TorchDispatchMode):
    def __init__(self, modules=(), device: torch.device | str | None = None) -> None:
        super().__init__()
        self.simulated = device is None or torch.device(device).type == "cpu"
        self.events: list[tuple[str, str]] = []
        self._thread = threading.get_ident()
        self._patched: dict[str, object] = {}
        self.follow(*modules)

    def follow(self, *modules) -> None:
        """The parameters and buffers of ``modules`` are the device's (on CPU)."""
        for module in modules:
            for tensor in (*module.parameters(), *module.buffers()):
                self.mark(tensor)

    # Which tensors are the device's -----------------------------------------------------------

    def mark(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` is the device's from now on (on CPU; on an accelerator its device says so)."""
        if self.simulated:
            setattr(tensor, _TAINT, True)
        return tensor

    def on_device(self, value) -> bool:
        if not isinstance(value, torch.Tensor):
            return False
        if self.simulated:
            return getattr(value, _TAINT, False)
        return value.device.type != "cpu"

    # Counting ---------------------------------------------------------------------------------

    def count(self, what: str) -> None:
        library, where = _caller()
        # A library's own syncs (fbgemm's, TorchRec's) are not FreeScale's to budget: on a GPU
        # they are noted apart; on CPU, where a library runs its CPU path rather than the one it
        # runs on a GPU, they say nothing of a GPU run and are left out.
        if library and self.simulated:
            return
        self.events.append(("library sync" if library else "sync", f"{what} at {where}"))

    @property
    def syncs(self) -> list[str]:
        return [what for kind, what in self.events if kind == "sync"]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs, _ = tree_flatten((args, kwargs))
        from_device = any(self.on_device(t) for t in inputs)
        what = self._sync(func, args, kwargs, inputs, from_device)
        if what:
            self.count(what)
        out = func(*args, **kwargs)
        # (A copy into a host buffer leaves it the host's.)
        if self.simulated and (from_device and func is not aten.copy_.default or func is aten.alias.default):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.mark(t)
        return out

    def _sync(self, func, args, kwargs, inputs, from_device: bool) -> str | None:
        if not from_device:
            return None
        if func in _ALWAYS:
            return _ALWAYS[func]
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            return "repeat_interleave without output_size"
        if func in _MASK_INDEXED:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
                return "boolean-mask indexing"
        if func is aten.copy_.default and not self.on_device(args[0]) and self.on_device(args[1]):
            return "copy to the host"
        if func is aten._to_copy.default and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == "cpu":
            return "copy to the host"
        return None

    # The Tensor methods that read values without an aten operation -----------------------------

    def __enter__(self):
        counter = self
        for name, what in (("tolist", "tolist"), ("numpy", "numpy"), ("cpu", "copy to the host")):
            original = getattr(torch.Tensor, name)
            self._patched[name] = original

            def patched(tensor, *args, _original=original, _what=what, **kwargs):
                # (Patched on the class: only the thread that counts is counted, not the transports'.)
                if threading.get_ident() == counter._thread and counter.on_device(tensor):
                    counter.count(_what)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, patched)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        self._patched = {}
        return super().__exit__(*exc)


LIBRARIES = ("fbgemm_gpu", "torchrec", "torchft")


def _caller() -> tuple[bool, str]:
    """Where the sync was asked for: the innermost frame outside torch and this file, and whether
    it is in one of the ``LIBRARIES`` rather than FreeScale's code."""
    here = os.path.abspath(__file__)
    for frame in reversed(traceback.extract_stack()):
        path = frame.filename
        parts = path.split(os.sep)
        if path == here or "torch" in parts:
            continue
        library = any(name in parts for name in LIBRARIES)
        short = path.split(os.sep + "freescale" + os.sep)[-1] if os.sep + "freescale" + os.sep in path else path
        return library, f"{short}:{frame.lineno} ({frame.name})"
    return False, "unknown"
