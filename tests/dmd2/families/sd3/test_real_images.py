"""The GAN's real images for SD3 (dmd2/families/sd3/real_images.py, `SD3Family.prepare` / `bind` /
`real_source`) on the tiny pipeline: the stored latents against an explicit crop, resize and VAE encode,
the captions as prompt-table rows, the prepared key, and a critic step whose L_D reaches the head."""

import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from dmd2.config import DMD2Config, config_from_dict
from dmd2.convert import TrainPairs
from dmd2.critic import training_sigma
from dmd2.families.sd3.conditioning import negative_indices, prompt_indices
from dmd2.families.sd3.family import SD3Family
from dmd2.families.sd3.prompts import encode_prompt_table
from dmd2.gan import HEAD_NAME, attach_gan_head, tapped
from dmd2.hooks import critic_loss_hook, critic_step_pairs
from dmd2.plan import RolloutPlan
from dmd2.schedule import add_noise
from dmd2.trainer import HookContext
from tests.dmd2.families.prepared_parts import assert_parts_merge_to_the_whole

PROMPTS = ["a photo of a cat", "a red dog"]
SIZES = {"a.png": (16, 16), "b.png": (24, 16), "c.png": (20, 28)}  # (width, height): square, wide, tall
SHAPE = (4, 8, 8)  # the tiny pipeline's latents at its default resolution, 16


def image_folder(folder):
    """Three tiny random PNGs, b.png captioned, and a file that is not an image."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name, (width, height) in SIZES.items():
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(folder / name)
    (folder / "b.txt").write_text("a blue sign\n")
    (folder / "notes.md").write_text("not an image")
    return folder


def recipe(sd3_dir, tmp_path, images):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS))
    config = config_from_dict({"model": {"family": "sd3", "teacher": str(sd3_dir)},
                               "data": {"prompts": str(prompts), "images": str(images)},
                               "dmd2": {"critic_gan_weight": 0.5}})
    return SD3Family().resolve(config, tmp_path)  # [data] resolution: the pipeline's 16


@pytest.fixture(scope="module")
def prepared(sd3_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("real")
    config = recipe(sd3_dir, tmp, image_folder(tmp / "images"))
    return config, SD3Family().prepare(config)


def explicit_mean(vae, path, resolution):
    """The central square by hand, Lanczos-resized, to [-1, 1]; the first half of the encoder's moments: the
    latent distribution's mean (SD3's VAE has no quant conv)."""
    image = Image.open(path).convert("RGB")
    width, height = image.size
    side = min(width, height)
    box = ((width - side) // 2, (height - side) // 2, (width - side) // 2 + side, (height - side) // 2 + side)
    pixels = np.asarray(image.crop(box).resize((resolution, resolution), Image.Resampling.LANCZOS), np.float64)
    x = torch.tensor(pixels / 255 * 2 - 1, dtype=torch.float32).permute(2, 0, 1)[None]
    with torch.no_grad():
        return vae.encoder(x)[0, :vae.config.latent_channels]


def test_the_prepared_latents_are_each_image_encoded_alone(prepared, sd3_pipe):
    config, tables = prepared
    latents = tables["real"]["latents"]
    assert latents.shape == (3, *SHAPE) and latents.dtype == torch.float32
    shift, scale = sd3_pipe.vae.config.shift_factor, sd3_pipe.vae.config.scaling_factor
    for row, name in enumerate(sorted(SIZES)):
        mean = explicit_mean(sd3_pipe.vae, f"{config.data.images}/{name}", 16)
        assert torch.allclose(latents[row], (mean - shift) * scale, atol=1e-5), name
        assert torch.allclose(latents[row] / scale + shift, mean, atol=1e-5)  # what the pipeline decodes


def test_the_captions_are_rows_of_the_prompt_table_after_the_prompts(prepared, sd3_pipe):
    _, tables = prepared
    # rows: the 2 prompts, the eval prompts (the same 2), then the new captions "" (a.png, c.png), "a blue sign"
    assert tables["real"]["prompt_index"].tolist() == [4, 5, 4]
    embeds = tables["prompts"]["prompt_embeds"]
    assert embeds.shape[0] == 6
    alone = encode_prompt_table(sd3_pipe, ["", "a blue sign"], "")
    assert torch.allclose(embeds[4:], alone["prompt_embeds"], atol=1e-6)
    assert torch.allclose(tables["prompts"]["pooled_prompt_embeds"][4:], alone["pooled_prompt_embeds"], atol=1e-6)


def test_the_prepared_key_follows_the_images_their_captions_and_the_vae(sd3_dir, tmp_path):
    family, folder = SD3Family(), image_folder(tmp_path / "images")
    config = recipe(sd3_dir, tmp_path, folder)
    key = family.prepared_key(config)
    assert family.prepared_key(config) == key
    without = family.prepared_key(config.replace("data", images="").replace("dmd2", critic_gan_weight=0.0))
    assert without != key
    (folder / "b.txt").write_text("a red sign")
    assert family.prepared_key(config) not in (key, without)
    (folder / "b.txt").write_text("a blue sign\n")
    assert family.prepared_key(config) == key  # the caption as read: stripped
    Image.new("RGB", (16, 16), (1, 2, 3)).save(folder / "a.png")
    assert family.prepared_key(config) not in (key, without)
    image_folder(tmp_path / "again")  # the same bytes elsewhere: the same key
    assert family.prepared_key(config.replace("data", images=str(tmp_path / "again"))) == key

    teacher = shutil.copytree(sd3_dir, tmp_path / "teacher")
    config = config.replace("model", teacher=str(teacher)).replace("data", images=str(tmp_path / "again"))
    assert family.prepared_key(config) == key
    vae_config = teacher / "vae" / "config.json"
    vae_config.write_text(vae_config.read_text().replace("{", '{"_note": "another VAE",', 1))
    assert family.prepared_key(config) != key


def test_a_critic_step_with_the_gan_trains_the_head_on_the_bound_images(prepared, sd3_dir, tmp_path):
    config, tables = prepared
    family = SD3Family()
    spec = family.run_spec(config, tmp_path)
    assert spec.real is None  # the driver has no images: the bound family has them
    family = family.bind(tables)
    real = family.real_source(spec)
    assert torch.equal(real.x0, tables["real"]["latents"])

    model = family.load_model(str(sd3_dir))
    model = attach_gan_head(model, family.gan_tap(model), seed=0)
    critic = tapped(family.velocity(model), model)
    plan = RolloutPlan(seed=1, rollout_id=0, world_size=1, critic_steps=2, batch=2, sample_shape=SHAPE, num_steps=2,
                       shift=3.0)
    ctx = HookContext(plan, DMD2Config(critic_steps_per_rollout=2, critic_gan_weight=0.5), rank=0, real=real)
    g = torch.Generator().manual_seed(3)
    sigma = torch.tensor([0.9, 0.6, 0.4, 0.2])
    pairs = TrainPairs(torch.randn(4, *SHAPE, generator=g), torch.randn(4, *SHAPE, generator=g), sigma, 1000 * sigma,
                       torch.zeros(4, dtype=torch.long), prompt_indices(torch.tensor([0, 1, 1, 0])),
                       negative_indices(4), torch.arange(4))
    batch = critic_step_pairs(ctx, pairs, 0)
    loss, metrics, _ = critic_loss_hook(ctx, critic, batch, 0)
    assert math.isfinite(metrics["gan_d_loss"]) and math.isfinite(loss.item())

    # the same draws by hand, fakes and reals in forwards of their own; the reals carry their captions' rows
    draws, rows = plan.draws, batch.sample_index
    index = draws.integers("gan/real", 3, rows)
    real_sigma = training_sigma(draws.uniform("gan/sigma", rows), 1.0)
    x_s_real = add_noise(tables["real"]["latents"][index], draws.normal("gan/noise", rows, SHAPE), real_sigma)
    captions = torch.tensor([4, 5, 4])[index]
    fake_sigma = training_sigma(draws.uniform("critic/sigma", rows), 1.0)
    x_s_fake = add_noise(batch.x0, draws.normal("critic/noise", rows, SHAPE), fake_sigma)
    with torch.no_grad():
        _, logits_real = critic.with_logits(x_s_real, real_sigma, prompt_indices(captions))
        _, logits_fake = critic.with_logits(x_s_fake, fake_sigma, batch.cond)
    d_loss = F.softplus(-logits_real).mean() + F.softplus(logits_fake).mean()
    assert metrics["gan_d_loss"] == pytest.approx(d_loss.item(), rel=1e-4)

    loss.backward()
    head = model.get_submodule(HEAD_NAME)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())


def test_the_real_images_are_part_0s_when_several_workers_prepare(prepared):
    """Every worker encodes its part of the prompt table; the first alone encodes the images (here all the rows fit
    one encoder batch, so the second part is empty)."""
    parts = assert_parts_merge_to_the_whole(SD3Family(), prepared[0], 2)
    assert parts[1] == {} and set(parts[0]) == {"prompts", "real"}
