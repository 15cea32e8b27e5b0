"""The in-process loop end to end on a tiny diffusers UNet built from a config."""

import torch
from diffusers import AutoModel

from dmd2.conditioning import ClassLabels
from dmd2.config import DistillConfig, DMD2Config, ModelConfig, OptimConfig, StudentConfig, TrainConfig
from dmd2.families.digits.model import build_digits_unet
from dmd2.loop import InProcessDistiller


def tiny_teacher(tmp_path):
    torch.manual_seed(0)
    build_digits_unet(block_out_channels=(8, 16), norm_num_groups=4).save_pretrained(tmp_path / "teacher")
    return AutoModel.from_pretrained(str(tmp_path / "teacher"))  # the path a user's hub model takes


def config(**dmd2):
    return DistillConfig(model=ModelConfig(teacher="tiny"), student=StudentConfig(num_steps=2),
                         optim=OptimConfig(lr=1e-3, critic_lr=2e-3), dmd2=DMD2Config(teacher_guidance_scale=2.0, **dmd2),
                         train=TrainConfig(rollouts=3, rollout_batch_size=12, seed=3))


def run(tmp_path, cfg):
    distiller = InProcessDistiller.from_models(cfg, tiny_teacher(tmp_path), ClassLabels(10, 10), (1, 8, 8))
    metrics = []
    distiller.run(range(cfg.train.rollouts), lambda r, m: metrics.append(m))
    return distiller, metrics


def test_rollouts_train_both_models_and_report_every_metric(tmp_path):
    distiller, metrics = run(tmp_path, config(critic_steps_per_rollout=3))
    teacher = tiny_teacher(tmp_path).state_dict()
    for model in (distiller.student.model, distiller.critic.model):
        changed = [not torch.equal(p, teacher[k]) for k, p in model.state_dict().items()]
        assert any(changed)
    assert len(metrics) == 3
    expected = {"loss", "grad_norm", "lr", "dmd_grad_abs", "dmd_normaliser", "x0_recompute_max_diff",
                "critic-loss", "critic-grad_norm", "critic-lr"}
    assert expected <= set(metrics[0])
    assert metrics[0]["lr"] == 1e-3 and metrics[0]["critic-lr"] == 2e-3
    # the actor trains on the weights it rolled out with: the recompute matches the rollout
    assert all(m["x0_recompute_max_diff"] < 1e-5 for m in metrics)
    assert all(torch.isfinite(torch.tensor(list(m.values()))).all() for m in metrics)


def test_the_same_seed_replays_the_same_run(tmp_path):
    first, _ = run(tmp_path, config(critic_steps_per_rollout=2, critic_scoring="original", critic_loss_space="x0"))
    second, _ = run(tmp_path, config(critic_steps_per_rollout=2, critic_scoring="original", critic_loss_space="x0"))
    for (name, a), b in zip(first.student.model.state_dict().items(), second.student.model.state_dict().values()):
        assert torch.equal(a, b), name
