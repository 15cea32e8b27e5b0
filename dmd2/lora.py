"""LoRA distillation: the student (and with `[student] critic_lora` the critic) trains low-rank adapters
over frozen base weights, its init's (by default the teacher's).

LoRA (Hu et al. 2021, eq. 3): an adapted layer keeps its weight W frozen and computes
`W x + (alpha / r) B A x`, A [r, in] random and B [out, r] zero at the start, so the adapted model
starts as exactly its base. The adapters are peft's (`peft.functional`, its API for models that are
not a `PeftModel`: diffusers' `UNet2DModel` has no `PeftAdapterMixin`), injected in place under the
adapter name `ADAPTER`; only their parameters require grad, so only they reach the optimizer, the
checkpoints (`infra.trainers.sharded`) and the EMA. Which layers a family adapts is its
`ModelFamily.lora_targets` (peft `target_modules`: module names or name suffixes).

An export holds both: the merged model (`merged_copy`, loadable as a full fine-tune's) and the adapter
alone (`save_peft_adapter`, or a family's own format such as diffusers' LoRA files).
"""

import copy
from contextlib import ExitStack
from pathlib import Path

import torch
from torch import Tensor, nn

from dmd2.config import DistillConfig
from dmd2.draws import seeded_generator

ADAPTER = "default"  # peft's default adapter name: the only one a model here holds


def add_adapters(model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...], seed: int) -> nn.Module:
    """`model` with LoRA adapters of rank `rank` and scale `alpha / rank` on its `targets` layers, in place.

    Every base parameter is frozen; A is drawn (kaiming-uniform, peft's init) from `seed` alone, so every
    rank of a group and every replay of a run starts from the same adapters; B is zero.
    """
    from peft import LoraConfig
    from peft.functional import inject_adapter_in_model
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

    if not targets:
        raise ValueError("[student] lora_rank > 0, but the model family names no LoRA target layers "
                         "(ModelFamily.lora_targets): set lora_rank = 0 (full fine-tuning)")
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=True)
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    # A model on fake tensors (`dmd2 plan`'s rehearsal) gets its adapters on meta (real meta tensors, which peft
    # leaves where they are), then fake ones where the base layers are: peft would move fake adapters there, a move
    # swaps tensors, and a fake tensor refuses to be swapped.
    on_fake = any(is_fake(p) for p in model.parameters())
    with torch.random.fork_rng(devices=devices), ExitStack() as made:  # the global RNG stays as it was (peft draws)
        if on_fake:
            made.enter_context(unset_fake_temporarily())
            made.enter_context(torch.device("meta"))
        torch.manual_seed(seed)
        model = inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    if on_fake:
        base = next(p for p in model.parameters() if p.device.type != "meta")
        for module in model.modules():
            if any(p.device.type == "meta" for p in module.parameters(recurse=False)):
                with unset_fake_temporarily():
                    module.to(dtype=base.dtype)  # as peft casts adapters to their base layer's dtype
                module.to_empty(device=base.device, recurse=False)
    return model


def with_role_adapters(model: nn.Module, config: DistillConfig, role: str, targets: tuple[str, ...]) -> nn.Module:
    """`model` as the `role` group ("actor" or "critic") trains it: with adapters under `[student] lora_rank`
    > 0 (the critic only with `critic_lora`), else unchanged (full fine-tuning)."""
    student = config.student
    if student.lora_rank == 0 or (role == "critic" and not student.critic_lora):
        return model
    seed = seeded_generator(config.train.seed, "lora", role).initial_seed()
    return add_adapters(model, student.lora_rank, student.adapter_alpha, targets, seed)


def has_adapters(model: nn.Module) -> bool:
    return ADAPTER in (getattr(model, "peft_config", None) or {})


def adapter_config(model: nn.Module):
    """The adapter's peft `LoraConfig` (rank, alpha, target modules)."""
    return model.peft_config[ADAPTER]


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapter's tensors in peft's format: `<module>.lora_A.weight`, `<module>.lora_B.weight`."""
    from peft.functional import get_peft_model_state_dict

    return {key: value.detach().contiguous() for key, value in
            get_peft_model_state_dict(model, adapter_name=ADAPTER).items()}


def add_adapters_like(model: nn.Module, source: nn.Module) -> nn.Module:
    """`model` (a fresh one of `source`'s class and config) with the adapter layers `source` has, in place;
    their values are whatever is loaded next (e.g. an unsharded copy's state dict)."""
    from peft.functional import inject_adapter_in_model

    return inject_adapter_in_model(copy.deepcopy(adapter_config(source)), model, adapter_name=ADAPTER)


def _is_adapter_key(key: str) -> bool:
    return any(part.startswith("lora_") for part in key.split("."))


@torch.no_grad()
def merged_copy(model: nn.Module) -> nn.Module:
    """A plain model of `model`'s diffusers class and config, without peft layers, each adapted weight
    merged: W + (alpha / r) B A, peft's own delta (`get_delta_weight`, what its `merge` adds).

    The tensors of layers without adapters are `model`'s own, shared, not copied; `model` is unchanged.
    """
    from accelerate import init_empty_weights
    from peft.tuners.lora import LoraLayer

    layers = {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    state = {}
    for key, value in model.state_dict().items():
        owner, base, leaf = key.rpartition(".base_layer.")
        if base:
            key = f"{owner}.{leaf}"
            if leaf == "weight":
                value = value + layers[owner].get_delta_weight(ADAPTER)
        elif _is_adapter_key(key):
            continue
        state[key] = value
    with init_empty_weights(include_buffers=False):  # weights come from `state`: no init to pay for
        plain = type(model).from_config(model.config)
    plain.load_state_dict(state, strict=True, assign=True)
    return plain


def save_peft_adapter(model: nn.Module, out_dir: Path, base_model: str) -> None:
    """The adapter in peft's own format (`PeftModel.save_pretrained`'s): `adapter_config.json` and
    `adapter_model.safetensors` in `out_dir` (created), loadable onto the base model with
    `peft.PeftModel.from_pretrained(base, out_dir)`."""
    from peft.utils.constants import SAFETENSORS_WEIGHTS_NAME
    from safetensors.torch import save_file

    config = copy.deepcopy(adapter_config(model))
    config.base_model_name_or_path = base_model
    out_dir.mkdir(parents=True)
    config.save_pretrained(str(out_dir))
    # A PeftModel holds the adapted model as `base_model.model`: its saved keys carry that prefix.
    state = {f"base_model.model.{key}": value for key, value in adapter_state(model).items()}
    save_file(state, str(out_dir / SAFETENSORS_WEIGHTS_NAME))
