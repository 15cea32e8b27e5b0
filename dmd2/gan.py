"""The GAN head of DMD2 (Yin et al. 2024, §4.3; tianweiy/DMD2 `cls_pred_branch`): a small classifier on the
critic's intermediate features that tells noised real samples from noised student samples.

The critic (the fake score) doubles as the discriminator's trunk: a forward hook reads the features of one
of its modules (the family's `gan_tap`: the digits UNet's `mid_block` [B, C, h, w], SD3's middle transformer
block's hidden states [B, L, D]) and the head maps them to one logit per sample. The losses are the
non-saturating logistic ones (Goodfellow et al. 2014), on samples noised as the critic's own are:
    L_D = mean_b softplus(-D(x_real_b)) + mean_b softplus(D(x_fake_b))    the critic and its head
    L_G = mean_b softplus(-D(x_fake_b))                                   the student
The student and the critic live in different trainer groups, so L_G's gradient is formed where the critic
is, like the DMD gradient: at scoring, w.r.t. the student's x0_hat only (`generator_gradient`), and the actor
applies it through a surrogate (`generator_surrogate`).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dmd2.critic import training_sigma
from dmd2.draws import Device, RolloutDraws
from dmd2.model import Cond, VelocityFn, cat_cond, cond_rows
from dmd2.schedule import add_noise

HEAD_NAME = "gan_head"  # the head's name as a submodule of the critic (its state-dict prefix)


@dataclass(frozen=True)
class GanTap:
    """Where the head reads a critic's features: the dotted name of a module of the critic, the width of its
    output's features, and which element of a tuple output holds them (None: the output itself)."""

    module: str
    channels: int
    output_index: int | None = None


class RealSource(Protocol):
    def __call__(self, draws: RolloutDraws, rows: Tensor) -> tuple[Tensor, Cond]:
        """Real samples x0 [len(rows), *sample_shape] and their conds, one per row, drawn with `draws`."""


@dataclass(frozen=True, eq=False)
class RealSamples:
    """A RealSource over a table of real samples x0 [N, ...] with their conds [N, ...]: each row draws one,
    uniformly with replacement, from the stream "gan/real" (so any world size sees the same ones)."""

    x0: Tensor
    cond: Cond

    def __call__(self, draws: RolloutDraws, rows: Tensor) -> tuple[Tensor, Cond]:
        index = draws.integers("gan/real", len(self.x0), rows)
        return self.x0[index], cond_rows(self.cond, index)


class GanHead(nn.Module):
    """features [B, C, h, w] or [B, C, f, h, w] (a UNet's bottleneck, of pictures or videos) or [B, L, C] (a
    transformer's tokens) -> logits [B].

    Per token (a cell of the feature map, or a token): LayerNorm, Linear(C, H), SiLU, Linear(H, H), SiLU;
    then the mean over tokens and Linear(H, 1). Every sample's logit depends on that sample alone.
    """

    def __init__(self, tap: GanTap, hidden: int = 256):
        super().__init__()
        self.tap = tap
        self.tokens = nn.Sequential(nn.LayerNorm(tap.channels), nn.Linear(tap.channels, hidden), nn.SiLU(),
                                    nn.Linear(hidden, hidden), nn.SiLU())
        self.out = nn.Linear(hidden, 1)

    def forward(self, features: Tensor) -> Tensor:
        if features.dim() < 3:
            raise ValueError(f"the GAN head reads [B, C, ...] feature maps or [B, L, C] tokens, got "
                             f"{tuple(features.shape)}")
        tokens = features.flatten(2).transpose(1, 2) if features.dim() >= 4 else features
        return self.out(self.tokens(tokens).mean(1)).squeeze(1).float()


def attach_gan_head(critic: nn.Module, tap: GanTap, seed: int) -> nn.Module:
    """`critic` with a new GAN head registered as its submodule `gan_head`, initialised from `seed`.

    A submodule rather than a wrapper, so the head goes wherever the critic goes, with no change there: its
    parameters are in the critic's optimizer (the critic's lr), its state dict (checkpoints keep the critic's
    own names and add `gan_head.*`, where a wrapper would prefix them all), what sleep parks on the host, and
    DDP's and FSDP2's root group (it runs inside the critic's forward, see `TappedCritic`); and the critic is
    still the model its family loads and calls. Seeded: every rank starts from the same head (DDP does not
    broadcast), at any world size.
    """
    device = next(critic.parameters()).device
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = GanHead(tap)
    critic.add_module(HEAD_NAME, head.to(device))
    return critic


class TappedCritic:
    """A critic's velocity call (a VelocityFn) that can also give its GAN head's logits from the same forward.

    `model` is the critic module (unwrapped: DDP's wrapper calls it). The tap's hook only keeps the features;
    the head runs in a hook at the end of the critic's own forward (placed before FSDP2's, which reshards):
    there the head's parameters, in FSDP2's root group, are gathered, and no activation checkpointing of the
    tapped block (SD3's) would replay it without the hook.
    """

    def __init__(self, velocity: VelocityFn, model: nn.Module):
        self.velocity, self.model = velocity, model
        self.head: GanHead = model.get_submodule(HEAD_NAME)
        self.tapped = model.get_submodule(self.head.tap.module)

    def __call__(self, x_s: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        return self.velocity(x_s, sigma, cond)

    def with_logits(self, x_s: Tensor, sigma: Tensor, cond: Cond) -> tuple[Tensor, Tensor]:
        """(v [B, ...], logits [B]) of one forward."""
        with self._hooks() as logits:
            v = self.velocity(x_s, sigma, cond)
        if len(logits) != 1:
            raise RuntimeError(f"the GAN tap {self.head.tap.module!r} ran {len(logits)} times in one forward of the "
                               "critic; tap a module that runs once")
        return v, logits[0]

    @contextmanager
    def _hooks(self) -> Iterator[list[Tensor]]:
        index, features, logits = self.head.tap.output_index, [], []

        def keep(module, args, output):
            features.append(output if index is None else output[index])

        def classify(module, args, output):
            logits.extend(self.head(f).clone() for f in features)  # a view's hook would drop with an in-place op
            # Returned with the output (the velocity call reads its first element), so that FSDP2's hook, which
            # runs next, hooks the logits' backward too: a GAN gradient enters the critic through them (at scoring
            # only through them) and must find the root's resharded parameters, the head's among them, gathered.
            return (*output, *logits) if isinstance(output, tuple) else output

        handles = [self.tapped.register_forward_hook(keep), self.model.register_forward_hook(classify, prepend=True)]
        try:
            yield logits
        finally:
            for handle in handles:
                handle.remove()


def tapped(velocity: VelocityFn, model: nn.Module) -> VelocityFn:
    """`velocity` as a `TappedCritic` when `model` carries a GAN head, else unchanged."""
    return TappedCritic(velocity, model) if hasattr(model, HEAD_NAME) else velocity


def noised_real(real: RealSource, draws: RolloutDraws, rows: Tensor, sample_shape: tuple[int, ...], device: Device,
                *, shift: float, sigma_range: tuple[float, float], sampling: str) -> tuple[Tensor, Tensor, Cond]:
    """Real samples for rows `rows`, noised as the critic's samples are: sigma from `training_sigma` (the same
    shift, range and sampling), x_s = (1 - sigma) x0 + sigma eps; draws "gan/real", "gan/noise", "gan/sigma".
    Returns (x_s [B, ...], sigma [B], cond), on `device`."""
    x0, cond = real(draws, rows)
    eps = draws.normal("gan/noise", rows, sample_shape, device)
    sigma = training_sigma(draws.uniform("gan/sigma", rows, device), shift, sigma_range, sampling)
    return add_noise(x0.to(device), eps, sigma), sigma, {key: value.to(device) for key, value in cond.items()}


class WithRealRows:
    """The critic's call on a batch with noised real rows appended: one forward (one collective under FSDP2,
    one gradient reduction under DDP) makes the flow-matching velocity of the batch and the head's logits of
    both. A VelocityFn returning the batch's velocity; after the call, `logits_fake` [B] and `logits_real` [R]."""

    def __init__(self, critic: TappedCritic, x_s_real: Tensor, sigma_real: Tensor, cond_real: Cond):
        self.critic, self.real = critic, (x_s_real, sigma_real, cond_real)
        self.logits_fake = self.logits_real = None

    def __call__(self, x_s: Tensor, sigma: Tensor, cond: Cond) -> Tensor:
        x_s_real, sigma_real, cond_real = self.real
        n = x_s.shape[0]
        v, logits = self.critic.with_logits(torch.cat([x_s, x_s_real]), torch.cat([sigma, sigma_real]),
                                            cat_cond(cond, cond_real))
        self.logits_fake, self.logits_real = logits[:n], logits[n:]
        return v[:n]


def discriminator_loss(logits_real: Tensor, logits_fake: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """L_D = mean_b softplus(-D(x_real_b)) + mean_b softplus(D(x_fake_b)) (tianweiy/DMD2
    `compute_guidance_cls_loss`); logits [B] each. Returns (scalar loss, its value and both logits' means)."""
    loss = F.softplus(-logits_real.float()).mean() + F.softplus(logits_fake.float()).mean()
    return loss, {"gan_d_loss": loss.detach(), "gan_logit_real": logits_real.detach().float().mean(),
                  "gan_logit_fake": logits_fake.detach().float().mean()}


def generator_loss(logits_fake: Tensor) -> Tensor:
    """L_G = mean_b softplus(-D(x_fake_b)) (tianweiy/DMD2 `compute_generator_clean_cls_loss`); logits [B]."""
    return F.softplus(-logits_fake.float()).mean()


def generator_gradient(critic: TappedCritic, x_s: Tensor, sigma: Tensor, cond: Cond) -> tuple[Tensor, Tensor]:
    """Per sample, g_b = d softplus(-D(x_s_b)) / d x0_hat_b = (1 - sigma_b) d softplus(-D(x_s_b)) / d x_s_b, for
    x_s = (1 - sigma) x0_hat + sigma eps (the kept scoring inputs), through the critic and its head.

    Only x_s gets a gradient (`torch.autograd.grad`): no parameter of the critic or the head is touched. The
    gradient of the batch's sum is each sample's own, as D of one sample reads that sample alone.
    Returns (g [B, ...] float32, logits [B], detached).
    """
    with torch.enable_grad():
        x_s = x_s.detach().requires_grad_(True)
        _, logits = critic.with_logits(x_s, sigma, cond)
        (grad,) = torch.autograd.grad(F.softplus(-logits.float()).sum(), x_s)
    shape = (-1,) + (1,) * (x_s.dim() - 1)
    return (1 - sigma.float()).reshape(shape) * grad.float(), logits.detach()


def generator_surrogate(x0_hat: Tensor, gan_grad: Tensor, logits: Tensor) -> Tensor:
    """The student's L_G from the critic side's `generator_gradient` g: its value is L_G (from the scored
    logits) and its gradient w.r.t. x0_hat [B, ...] is g / B, i.e. that of L_G while x0_hat is the rollout's:
        s = mean_b <x0_hat_b, sg(g_b)>,   loss = s - sg(s) + sg(L_G)."""
    inner = (x0_hat.float() * gan_grad.detach().float()).flatten(1).sum(1).mean()
    return inner - inner.detach() + generator_loss(logits.detach())
