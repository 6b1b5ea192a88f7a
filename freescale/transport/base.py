"""The transport interface: what every communicator promises, and the checks it makes first.

A transport moves bytes for the collectives that carry no reduction: ``all_to_all_single``
with uneven splits (zero-length splits included) and ``all_gather`` (equal or uneven sizes).
Both are asynchronous: they return a ``Handle`` whose ``wait()`` returns the result and
raises ``TransportError`` if the collective failed (a peer died, the timeout passed, the
transport was aborted or closed).

Collectives run per *lane* in the order they are issued, the same order on every rank; a
transport built with two lanes (``lanes=2``) lets a ``HIGH`` collective pass the ``NORMAL``
ones already queued or in flight (``torch_dist``: one process group per lane; ``host_staged``:
a queue and rings per lane, stepped by one proxy, the high lane first). A transport says how
many it has (``lanes``); one built with one lane refuses ``HIGH``, so a caller that can run
without priority asks for ``NORMAL`` there instead.

Splits and sizes count rows along dimension 0; every rank must pass the same ``sizes`` to
``all_gather`` and matching splits to ``all_to_all_single`` (rank i's input split j is rank
j's output split i). Before any byte moves, a transport checks what it can see on its own
rank (``check_all_to_all`` / ``check_all_gather``): a violation raises ``TransportError``
naming the operation, the rank and the values, and leaves the transport usable. What only
the peers can see (their splits disagree with this rank's) fails the collective on every
rank involved.

Errors are state, as in torch's and torchft's process groups: a transport whose collective
failed says so (``errored()``), refuses later collectives with the cause, and can be told to
give up at once (``abort()``, from any thread: every pending collective fails now). The
layer above decides whether to build a new one. ``close()`` releases it; collectives still
queued then fail.
"""

from __future__ import annotations

import operator
from typing import Protocol, Sequence

import torch


class TransportError(RuntimeError):
    """A collective that did not complete, or was refused; the message names the operation and the cause."""


NORMAL = 0
"""The lane every collective takes unless told otherwise."""
HIGH = 1
"""The priority lane: a collective on it does not queue behind the normal lane's."""

SUPPORTED_DTYPES = frozenset({
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
})
"""Element types every transport moves (what gloo's all-to-all and all-gather take)."""


class Handle(Protocol):
    def wait(self) -> torch.Tensor: ...

    def completed(self) -> bool:
        """Whether the collective is over (``wait()`` then returns or raises at once)."""


class Transport(Protocol):
    rank: int
    world_size: int
    lanes: int
    """How many lanes it was built with (``NORMAL`` up to ``lanes - 1``)."""
    lane_has_threads: bool
    """Whether each lane runs threads of its own (``transport.lanes: auto`` then gives a rank
    with one core one lane)."""

    def all_to_all_single(self, tensor: torch.Tensor, input_splits: Sequence[int],
                          output_splits: Sequence[int], lane: int = NORMAL) -> Handle: ...

    def all_gather(self, tensor: torch.Tensor, sizes: Sequence[int] | None = None) -> Handle: ...

    def errored(self) -> Exception | None:
        """The error that failed this transport, or None while it is healthy."""

    def abort(self, cause: str = "aborted") -> None:
        """Fail every pending collective at once (from any thread); later ones are refused."""

    def close(self) -> None:
        """Release the transport; collectives still pending fail, later ones are refused."""


def check_all_to_all(name: str, rank: int, world_size: int, tensor, input_splits, output_splits
                     ) -> tuple[torch.Tensor, list[int], list[int]]:
    """The tensor (contiguous) and both split lists as ints, or ``TransportError`` saying what is wrong."""
    op = (name, "all_to_all_single", rank)  # formatted only when something is wrong
    tensor = _check_tensor(op, tensor)
    ins = _check_counts(op, "input_splits", input_splits, world_size)
    outs = _check_counts(op, "output_splits", output_splits, world_size)
    rows = tensor.shape[0]
    if sum(ins) != rows:
        raise _error(op, f"input_splits {ins} sum to {sum(ins)} but the tensor has {rows} rows")
    if ins[rank] != outs[rank]:
        raise _error(op, f"this rank's own share differs: input_splits[{rank}] = {ins[rank]} "
                         f"but output_splits[{rank}] = {outs[rank]}")
    return tensor, ins, outs


def check_all_gather(name: str, rank: int, world_size: int, tensor, sizes) -> tuple[torch.Tensor, list[int]]:
    """The tensor (contiguous) and every rank's row count, or ``TransportError`` saying what is wrong."""
    op = (name, "all_gather", rank)
    tensor = _check_tensor(op, tensor)
    if sizes is None:
        return tensor, [tensor.shape[0]] * world_size
    sizes = _check_counts(op, "sizes", sizes, world_size)
    if sizes[rank] != tensor.shape[0]:
        raise _error(op, f"sizes[{rank}] = {sizes[rank]} but the tensor has {tensor.shape[0]} rows")
    return tensor, sizes


def check_lanes(name: str, lanes: int) -> int:
    """``lanes`` if a transport can be built with that many, else ``ValueError``."""
    if lanes < 1:
        raise ValueError(f"{name}: expected at least one lane, got lanes={lanes}")
    return lanes


def check_lane(name: str, lane: int, lanes: int) -> int:
    """``lane`` if this transport has it, else ``TransportError``."""
    if lane not in range(lanes):
        raise TransportError(f"{name}: lane {lane} does not exist (this transport has {lanes}: "
                             f"build it with lanes=2 for a priority lane)")
    return lane


def _check_tensor(op: tuple, tensor) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise _error(op, f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() == 0:
        raise _error(op, "expected a tensor with at least one dimension (rows), got a 0-d tensor")
    if tensor.dtype not in SUPPORTED_DTYPES:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in SUPPORTED_DTYPES))
        raise _error(op, f"dtype {str(tensor.dtype).removeprefix('torch.')} is not supported (expected one of {names})")
    if not (tensor.is_cpu or tensor.is_cuda):
        raise _error(op, f"tensors on {tensor.device.type} are not supported (expected cpu or cuda)")
    return tensor.contiguous()


def _check_counts(op: tuple, what: str, values, world_size: int) -> list[int]:
    try:
        counts = list(map(operator.index, values))
    except TypeError:
        raise _error(op, f"{what} must be a list of integers, got {_show(values)}") from None
    if len(counts) != world_size:
        raise _error(op, f"{what} has {len(counts)} entries, expected one per rank ({world_size})")
    if counts and min(counts) < 0:
        raise _error(op, f"{what} {counts} has a negative entry")
    return counts


def _error(op: tuple, problem: str) -> TransportError:
    name, collective, rank = op
    return TransportError(f"{name} {collective} on rank {rank}: {problem}")


def _show(values) -> str:
    text = repr(values)
    return text if len(text) <= 80 else text[:77] + "..."
