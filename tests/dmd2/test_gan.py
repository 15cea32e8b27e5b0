"""The GAN head (dmd2/gan.py) on a tiny digits UNet critic built from its config: the losses against explicit
computations, where their gradients go, and the generator's critic-side gradient against plain backprop."""

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from dmd2.config import ConfigError, DistillConfig, DMD2Config, ModelConfig, OptimConfig, StudentConfig, TrainConfig
from dmd2.convert import TrainPairs
from dmd2.critic import ScoringInputs, training_sigma
from dmd2.families.digits.family import DigitsFamily
from dmd2.families.digits.model import build_digits_unet
from dmd2.gan import (
    HEAD_NAME,
    GanHead,
    GanTap,
    RealSamples,
    WithRealRows,
    attach_gan_head,
    discriminator_loss,
    noised_real,
    tapped,
)
from dmd2.hooks import actor_loss_hook, critic_loss_hook, critic_step_pairs, score
from dmd2.model import DiffusersVelocity
from dmd2.plan import RolloutPlan
from dmd2.schedule import add_noise
from dmd2.scoring import Scores
from dmd2.tensors import from_tensor_dict, to_tensor_dict
from dmd2.trainer import HookContext

SHAPE = (1, 8, 8)


def tiny_unet(seed: int):
    torch.manual_seed(seed)
    return build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4)


def tiny_critic(seed: int = 0):
    """A tiny digits UNet with its GAN head where the digits family taps it (the mid block, 16 channels)."""
    model = tiny_unet(seed)
    return attach_gan_head(model, DigitsFamily().gan_tap(model), seed=seed)


def plan(critic_steps=2, batch=3) -> RolloutPlan:
    return RolloutPlan(seed=1, rollout_id=0, world_size=1, critic_steps=critic_steps, batch=batch, sample_shape=SHAPE,
                       num_steps=2, shift=1.0)


def pairs(n: int, x0=None) -> TrainPairs:
    g = torch.Generator().manual_seed(5)
    sigma, latent, drawn = torch.rand(n, generator=g) * 0.8 + 0.2, torch.randn(n, *SHAPE, generator=g), torch.randn(
        n, *SHAPE, generator=g)
    return TrainPairs(latent, drawn if x0 is None else x0, sigma, sigma * 1000, torch.zeros(n, dtype=torch.long),
                      {"class_labels": torch.randint(10, (n,), generator=g)}, {"class_labels": torch.full((n,), 10)},
                      torch.arange(n))


def real_samples(n: int = 20) -> RealSamples:
    g = torch.Generator().manual_seed(9)
    return RealSamples(torch.rand(n, *SHAPE, generator=g) * 2 - 1, {"class_labels": torch.randint(10, (n,), generator=g)})


def explicit_logits(head: GanHead, features: torch.Tensor) -> list[float]:
    """The head by hand, sample by sample: per-token LayerNorm and two SiLU layers, the tokens' mean, a linear."""
    norm, first, _, second, _ = head.tokens
    logits = []
    for sample in features.detach().double():
        tokens = sample.reshape(sample.shape[0], -1).T if features.dim() >= 4 else sample  # [N, C]
        mean, var = tokens.mean(1, keepdim=True), tokens.var(1, unbiased=False, keepdim=True)
        x = (tokens - mean) / torch.sqrt(var + norm.eps) * norm.weight.double() + norm.bias.double()
        for layer in (first, second):
            x = x @ layer.weight.double().T + layer.bias.double()
            x = x * torch.sigmoid(x)
        logits.append((x.mean(0) @ head.out.weight.double().T + head.out.bias.double()).item())
    return logits


def softplus(z: float) -> float:
    return math.log1p(math.exp(z))


def mid_features(model, x_s, sigma, cond) -> torch.Tensor:
    """The critic's mid-block output, read with a hook of the test's own."""
    seen = []
    handle = model.mid_block.register_forward_hook(lambda module, args, output: seen.append(output))
    try:
        v = DiffusersVelocity(model)(x_s, sigma, cond)
    finally:
        handle.remove()
    return seen[0], v


def test_the_head_reads_every_feature_layout_as_an_explicit_computation():
    torch.manual_seed(0)
    # [B, C, h, w] (pictures), [B, C, f, h, w] (videos) and [B, L, D] (tokens)
    for features in (torch.randn(3, 6, 4, 4), torch.randn(3, 6, 2, 3, 4), torch.randn(3, 5, 6)):
        head = GanHead(GanTap("any", 6), hidden=7)
        assert head(features).shape == (3,)
        assert head(features).tolist() == pytest.approx(explicit_logits(head, features), rel=1e-5, abs=1e-6)


def test_critic_loss_is_flow_matching_plus_weighted_discriminator_loss_on_real_and_fake_rows():
    model, real, weight = tiny_critic(), real_samples(), 0.5
    rollout = plan()
    ctx = HookContext(rollout, DMD2Config(critic_steps_per_rollout=2, critic_gan_weight=weight), rank=0, real=real)
    batch = critic_step_pairs(ctx, pairs(6), 0)
    loss, metrics, kept = critic_loss_hook(ctx, tapped(DiffusersVelocity(model), model), batch, 0)
    assert kept is None

    draws, rows = rollout.draws, batch.sample_index  # the same draws, the rest by hand, fakes and reals apart
    eps = draws.normal("critic/noise", rows, SHAPE)
    sigma = training_sigma(draws.uniform("critic/sigma", rows), 1.0)
    fake_features, v = mid_features(model, add_noise(batch.x0, eps, sigma), sigma, batch.cond)
    index = draws.integers("gan/real", len(real.x0), rows)
    real_sigma = training_sigma(draws.uniform("gan/sigma", rows), 1.0)
    real_x_s = add_noise(real.x0[index], draws.normal("gan/noise", rows, SHAPE), real_sigma)
    real_features, _ = mid_features(model, real_x_s, real_sigma, {"class_labels": real.cond["class_labels"][index]})
    head = model.get_submodule(HEAD_NAME)
    fake, reals = explicit_logits(head, fake_features), explicit_logits(head, real_features)
    d_loss = sum(softplus(-r) for r in reals) / 3 + sum(softplus(f) for f in fake) / 3
    flow = sum(((v[b] - (eps[b] - batch.x0[b])) ** 2).mean().item() for b in range(3)) / 3
    assert loss.item() == pytest.approx(flow + weight * d_loss, rel=1e-5)
    assert metrics["gan_d_loss"] == pytest.approx(d_loss, rel=1e-5)
    assert metrics["gan_logit_real"] == pytest.approx(sum(reals) / 3, rel=1e-4, abs=1e-6)
    assert metrics["gan_logit_fake"] == pytest.approx(sum(fake) / 3, rel=1e-4, abs=1e-6)


def test_the_discriminator_loss_trains_the_head_and_the_critic_up_to_its_tap_and_never_the_student():
    model, student = tiny_critic(), tiny_unet(1)
    critic = tapped(DiffusersVelocity(model), model)
    source = pairs(3)
    x0_hat = source.latent - source.sigma[:, None, None, None] * DiffusersVelocity(student)(
        source.latent, source.sigma, source.cond)  # with the student's graph
    batch = pairs(3, x0=x0_hat)
    rollout = plan(critic_steps=1)
    ctx = HookContext(rollout, DMD2Config(critic_steps_per_rollout=1, critic_gan_weight=1.0), rank=0,
                      real=real_samples())
    loss, _, _ = critic_loss_hook(ctx, critic, batch, 0)
    loss.backward()
    assert all(p.grad is None for p in student.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.get_submodule(HEAD_NAME).parameters())

    model.zero_grad(set_to_none=True)  # L_D alone: it reaches the critic through the features it reads
    joint = WithRealRows(critic, *noised_real(ctx.real, rollout.draws, batch.sample_index, SHAPE, "cpu", shift=1.0,
                                              sigma_range=(0.0, 1.0), sampling="uniform"))
    joint(add_noise(batch.x0.detach(), torch.randn(3, *SHAPE), torch.rand(3)), torch.rand(3), batch.cond)
    d_loss, _ = discriminator_loss(joint.logits_real, joint.logits_fake)
    d_loss.backward()
    assert model.conv_in.weight.grad.abs().sum() > 0 and model.mid_block.resnets[0].conv1.weight.grad.abs().sum() > 0
    assert all(p.grad is None or p.grad.abs().sum() == 0 for p in model.conv_out.parameters())


def test_the_critic_side_gan_gradient_gives_the_student_the_gradient_of_weighted_l_g():
    critic_model, student, teacher, weight = tiny_critic(), tiny_unet(1), tiny_unet(2), 0.3
    critic = tapped(DiffusersVelocity(critic_model), critic_model)
    before = {k: v.clone() for k, v in critic_model.state_dict().items()}
    source = pairs(4)
    with torch.no_grad():
        x0_rollout = source.latent - source.sigma[:, None, None, None] * DiffusersVelocity(student)(
            source.latent, source.sigma, source.cond)
    batch = pairs(4, x0=x0_rollout)
    eps, sigma_s = torch.randn(4, *SHAPE), torch.tensor([0.1, 0.4, 0.6, 0.9])
    kept = ScoringInputs(add_noise(x0_rollout, eps, sigma_s), sigma_s, torch.randn(4, *SHAPE), batch.sample_index)
    dmd2 = DMD2Config(critic_steps_per_rollout=1, teacher_guidance_scale=2.0, gan_weight=weight, critic_gan_weight=0.1)
    ctx = HookContext(plan(critic_steps=1, batch=4), dmd2, rank=0)
    scores = score(DiffusersVelocity(teacher.requires_grad_(False)), kept, batch, ctx, critic)
    assert scores.gan_grad.shape == (4, *SHAPE) and scores.gan_logit.shape == (4,)
    assert all(p.grad is None for p in critic_model.parameters())  # only the input got a gradient

    # x0_fake = x0_real: the DMD gradient is exactly 0, so what the student gets is the GAN's part alone
    scores = dataclasses.replace(scores, x0_fake=scores.x0_real)
    loss, metrics, _ = actor_loss_hook(HookContext(ctx.plan, dmd2, rank=0, external_data={"critic": scores}),
                                       DiffusersVelocity(student), batch, 0)
    loss.backward()

    direct, direct_critic = copy.deepcopy(student), copy.deepcopy(critic_model)  # backprop through critic and head
    x0_hat = batch.latent - batch.sigma[:, None, None, None] * DiffusersVelocity(direct)(batch.latent, batch.sigma,
                                                                                       batch.cond)
    x_s = (1 - sigma_s[:, None, None, None]) * x0_hat + sigma_s[:, None, None, None] * eps
    _, logits = tapped(DiffusersVelocity(direct_critic), direct_critic).with_logits(x_s, sigma_s, batch.cond)
    l_g = F.softplus(-logits).mean()
    (weight * l_g).backward()
    assert metrics["gan_g_loss"] == pytest.approx(l_g.item(), rel=1e-5)
    assert loss.item() == pytest.approx(weight * l_g.item(), rel=1e-5)  # the loss's value is w L_G too
    grads = dict(student.named_parameters())
    for name, param in direct.named_parameters():
        assert torch.allclose(grads[name].grad, param.grad, rtol=1e-4, atol=1e-9), name
    assert any(param.grad.abs().sum() > 0 for param in direct.parameters())
    assert all(p.grad is None for p in critic_model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in critic_model.state_dict().items())


def test_scores_carry_the_gan_fields_through_their_tensor_dict_and_omit_them_when_unset():
    plain = Scores(torch.arange(2), torch.rand(2), torch.randn(2, *SHAPE), torch.randn(2, *SHAPE))
    assert from_tensor_dict(Scores, to_tensor_dict(plain)).gan_grad is None and "gan_grad" not in to_tensor_dict(plain)
    gan = Scores(plain.sample_index, plain.sigma, plain.x0_real, plain.x0_fake, torch.randn(2, *SHAPE), torch.randn(2))
    back = from_tensor_dict(Scores, to_tensor_dict(gan))
    assert torch.equal(back.gan_grad, gan.gan_grad) and torch.equal(back.gan_logit, gan.gan_logit)


def test_the_options_are_validated_naming_them():
    with pytest.raises(ConfigError, match="gan_weight = 0.01 needs a trained discriminator: set critic_gan_weight"):
        DistillConfig(model=ModelConfig(teacher="t"), dmd2=DMD2Config(gan_weight=0.01))
    with pytest.raises(ConfigError, match=r"\[dmd2\] critic_gan_weight must be >= 0"):
        DistillConfig(model=ModelConfig(teacher="t"), dmd2=DMD2Config(critic_gan_weight=-1.0))


def test_a_digits_run_with_the_gan_trains_the_head_on_the_train_split(tmp_path):
    from dmd2.loop import InProcessDistiller

    config = DistillConfig(model=ModelConfig(teacher="tiny"), student=StudentConfig(num_steps=2),
                           optim=OptimConfig(lr=1e-3), train=TrainConfig(rollouts=2, rollout_batch_size=8),
                           dmd2=DMD2Config(critic_steps_per_rollout=2, teacher_guidance_scale=2.0, gan_weight=3e-3,
                                           critic_gan_weight=1e-2))
    family = DigitsFamily()
    spec = family.run_spec(config, tmp_path)
    assert family.run_spec(config.replace("dmd2", gan_weight=0.0, critic_gan_weight=0.0), tmp_path).real is None
    assert spec.real.x0.shape[1:] == SHAPE and spec.real.x0.min() >= -1 and spec.real.x0.max() <= 1
    distiller = InProcessDistiller.from_models(config, tiny_unet(0), spec.conds, SHAPE, real=spec.real,
                                               gan_tap=family.gan_tap)
    head = {k: v.clone() for k, v in distiller.critic.model.get_submodule(HEAD_NAME).state_dict().items()}
    metrics = []
    distiller.run(range(2), lambda rollout_id, row: metrics.append(row))
    for key in ("gan_g_loss", "critic-gan_d_loss", "critic-gan_logit_real", "critic-gan_logit_fake"):
        assert all(math.isfinite(row[key]) for row in metrics), key
    trained = distiller.critic.model.get_submodule(HEAD_NAME).state_dict()
    assert all(not torch.equal(trained[k], v) for k, v in head.items())


def test_the_sd3_tap_reads_the_middle_block_tokens_under_activation_checkpointing():
    from dmd2.families.sd3.family import SD3Family
    from tests.dmd2.families.sd3.tiny_pipeline import tiny_sd3_transformer

    model = tiny_sd3_transformer(num_layers=3)
    model = attach_gan_head(model, SD3Family().gan_tap(model), seed=0)
    model.enable_gradient_checkpointing()  # the tapped block is recomputed in backward, without the hooks
    critic, g = tapped(DiffusersVelocity(model), model), torch.Generator().manual_seed(0)
    x_s, sigma = torch.randn(2, 4, 8, 8, generator=g), torch.tensor([0.3, 0.7])
    cond = {"encoder_hidden_states": torch.randn(2, 5, 32, generator=g), "pooled_projections": torch.randn(2, 32, generator=g)}
    seen = []
    model.transformer_blocks[1].register_forward_hook(lambda module, args, output: seen.append(output[1]))
    v, logits = critic.with_logits(x_s, sigma, cond)
    assert v.shape == x_s.shape and seen[0].shape == (2, 16, 16)  # [B, L, D]: 4 x 4 patches of width 16
    assert logits.tolist() == pytest.approx(explicit_logits(model.get_submodule(HEAD_NAME), seen[0]), rel=1e-5)
    F.softplus(-logits).mean().backward()
    assert model.transformer_blocks[0].attn.to_q.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.get_submodule(HEAD_NAME).parameters())
