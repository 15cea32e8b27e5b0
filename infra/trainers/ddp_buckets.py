"""DDP's memory without its collectives, for `dmd2 plan` (infra/trainers/memory_plan.py): DDP's reducer cannot run
on fake tensors, so a planned DDP rank holds what its wrapper would, one flat gradient buffer per dtype.
"""

import torch
from torch import nn

from dmd2.memory import block_bytes


class DdpBuckets(nn.Module):
    """What DDP's wrapper (`infra.trainers.parallel.ddp`) holds, without its collectives: one flat gradient buffer
    per dtype of the trained parameters (its buckets), alive as long as the wrapper; as with
    ``gradient_as_bucket_view``, each gradient autograd makes is copied into its view and replaced by it."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        trained = [param for param in module.parameters() if param.requires_grad]
        self.buckets, self._views = [], {}
        for dtype in dict.fromkeys(param.dtype for param in trained):
            params = [param for param in trained if param.dtype == dtype]
            self.buckets.append(torch.empty(sum(p.numel() for p in params), dtype=dtype, device=params[0].device))
            for param, view in zip(params, self.buckets[-1].split([p.numel() for p in params])):
                self._views[param] = view.view_as(param)
        self._hooks = [param.register_post_accumulate_grad_hook(self._into_bucket) for param in trained]

    @staticmethod
    def bytes_of(module: nn.Module) -> int:
        """The buckets' bytes for ``module``: one gradient per trained parameter."""
        return sum(block_bytes(p.numel() * p.element_size()) for p in module.parameters() if p.requires_grad)

    def _into_bucket(self, param: nn.Parameter) -> None:
        view = self._views[param]
        if param.grad is not view:
            view.copy_(param.grad)
            param.grad = view

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def remove(self) -> None:
        """Drop the buckets and their hooks (the ranks' sleep drops DDP's wrapper)."""
        for handle in self._hooks:
            handle.remove()
        self.buckets, self._views, self._hooks = [], {}, []
