"""The reference transport: ``torch.distributed`` collectives (gloo on CPU, NCCL on CUDA)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from freescale.transport.base import TransportError, register


class _WorkHandle:
    def __init__(self, op: str, work, finish) -> None:
        self.op = op
        self.work = work
        self.finish = finish

    def wait(self) -> torch.Tensor:
        try:
            self.work.wait()
        except RuntimeError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TransportError(f"torch_dist {self.op} failed: {first}") from e
        return self.finish()


@register("torch_dist")
class TorchDistTransport:
    def __init__(self, group: dist.ProcessGroup | None = None, cfg=None) -> None:
        self.group = group or dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)

    def all_to_all_single(self, tensor: torch.Tensor, input_splits: list[int], output_splits: list[int]):
        out = tensor.new_empty((sum(output_splits), *tensor.shape[1:]))
        work = dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=list(output_splits),
                                      input_split_sizes=list(input_splits), group=self.group, async_op=True)
        return _WorkHandle("all_to_all_single", work, lambda: out)

    def all_gather(self, tensor: torch.Tensor, sizes: list[int] | None = None):
        if sizes is None:
            sizes = [tensor.shape[0]] * self.world_size
        width = max(sizes) if sizes else 0
        padded = tensor.new_zeros((width, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        work = dist.all_gather(parts, padded, group=self.group, async_op=True)
        return _WorkHandle("all_gather", work, lambda: torch.cat([p[:n] for p, n in zip(parts, sizes)]))
