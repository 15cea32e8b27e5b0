"""Floating-point operations as `dmd2 plan` counts them: torch's own formulas over the operators' shapes (those of
`torch.utils.flop_counter.FlopCounterMode`), on real or fake tensors alike."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop, sdpa_flop, shape_wrapper

# The plan runs on CPU, where attention is a kernel torch's formulas do not name: count it as the GPU's flash
# attention, whose arguments it shares (query, key, value first; the backward's gradient before them). The
# formulas over shapes, as `FlopCounterMode(custom_mapping=...)` takes them.
CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: sdpa_flop.__wrapped__,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: sdpa_backward_flop.__wrapped__,
}
FLOP_FORMULAS = {**flop_registry, **{op: shape_wrapper(formula) for op, formula in CPU_ATTENTION_FLOPS.items()}}


class FlopCount(TorchDispatchMode):
    """The FLOPs of every operator run while it is entered, by torch's own formulas (`FLOP_FORMULAS`: those of
    `FlopCounterMode`, whose per-module tracking is left out: its backward hooks keep recomputed activations
    alive, and the ledger would count them)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (formula := FLOP_FORMULAS.get(func._overloadpacket)) is not None:
            self.total += formula(*args, **kwargs, out_val=out)
        return out
