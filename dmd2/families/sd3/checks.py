"""What the sd3 family accepts, decided from the pipeline's JSON files, the prompt file and the image folder's
listing alone.

Standard library only: the CLI asks `claims` and `check` (through the registry, dmd2/family.py)
before anything heavy loads, so a refused recipe costs no torch import; `SD3Family.claims` and
`.check` are these same functions. A hub id cannot be checked offline; when the local hub cache
holds it, its snapshot is checked like a directory.
"""

import json

from dmd2.config import ConfigError, DistillConfig
from dmd2.families.sd3.image_folder import read_image_folder
from dmd2.families.sd3.pipeline import check_flow_matching, check_sd3_pipeline, is_sd3_pipeline, latent_shape
from dmd2.families.sd3.prompt_file import read_prompts
from dmd2.model_specs import model_dir


BUILTIN_DIGITS_SD3 = "builtin:digits-sd3"  # the built-in text teacher: trained on sklearn's digits, cached on first use


def claims(teacher: str) -> bool:
    """Whether `[model] teacher` is a local StableDiffusion3Pipeline directory, or the built-in one."""
    return teacher == BUILTIN_DIGITS_SD3 or is_sd3_pipeline(teacher)


def check(config: DistillConfig) -> None:
    """Refuse teachers, students, critics, CLIP models, prompt files and image folders the family cannot run
    with."""
    try:
        _check_teacher(config)
        model = config.model
        for option, spec in (("student", model.student), ("critic_load", model.critic_load)):
            if not spec:
                continue
            path = model_dir(f"[model] {option}", spec)
            if path is None or not (is_sd3_pipeline(path) or (path / "transformer").is_dir()):
                raise ValueError(f"[model] {option} = {spec!r} is not an SD3 pipeline directory; give a "
                                 "StableDiffusion3Pipeline directory (e.g. an exported student)")
        if config.eval.clip_model:
            _check_clip(config.eval.clip_model)
        if config.eval.feature_model and not config.eval.feature_model.startswith("builtin:"):
            _check_feature_model(config.eval.feature_model)  # the built-in ones are the config rules' to name
        if not config.data.prompts:
            raise ValueError("[data] prompts is required by the sd3 family: a text file (one prompt a line) or "
                             "a .jsonl file with a \"prompt\" field")
        read_prompts(config.data.prompts)
        _check_real_images(config)
    except ValueError as error:  # a ConfigError too: every refusal is one, naming the option
        raise ConfigError(str(error)) from None
    video = [f"[data] {name}" for name in ("frames", "height", "width") if getattr(config.data, name)]
    if video:
        raise ConfigError(f"{', '.join(video)}: the sd3 family makes square pictures of [data] resolution; remove "
                          f"{'them' if len(video) > 1 else 'it'} (frames, height and width are a video family's)")
    if config.eval.num_samples != 1000:
        raise ConfigError("[eval] num_samples is read by the digits family only; the sd3 family samples "
                          "[eval] prompts: remove it")


def _check_teacher(config: DistillConfig) -> None:
    """A local (or cached) teacher must be a flow-matching SD3 pipeline whose latents fit `[data] resolution`."""
    spec = config.model.teacher
    if spec == BUILTIN_DIGITS_SD3:  # made by this code, at the size its recipe's options fit
        return
    teacher = model_dir("[model] teacher", spec)
    if teacher is None:  # a hub id, fetched when the run resolves it: its files are checked then
        return
    if not (teacher / "model_index.json").is_file():
        raise ValueError(f"[model] teacher = {spec!r} is neither a model nor a pipeline directory (no "
                         "model_index.json); give a StableDiffusion3Pipeline directory (save_pretrained) or a hub id")
    check_flow_matching(teacher)  # first: a DDPM pipeline is refused for what it lacks
    check_sd3_pipeline(teacher)
    if config.data.resolution:
        latent_shape(teacher, config.data.resolution)


def _check_real_images(config: DistillConfig) -> None:
    """The GAN's discriminator needs `[data] images`, and only it reads them: either without the other is refused
    (images nothing reads would still cost a VAE pass and a stored copy, and most likely mean a forgotten weight)."""
    gan = config.dmd2 is not None and config.dmd2.critic_gan_weight > 0
    if gan and not config.data.images:
        raise ValueError(f"[dmd2] critic_gan_weight = {config.dmd2.critic_gan_weight} needs real images for the GAN's "
                         "discriminator: set [data] images to a folder of them (png, jpg, jpeg or webp; a same-named "
                         ".txt beside an image is its caption), or set critic_gan_weight = 0 and gan_weight = 0")
    if config.data.images and not gan:
        raise ValueError("[data] images is read only by the GAN's discriminator: set [dmd2] critic_gan_weight > 0 "
                         "(e.g. 1e-2), or remove [data] images")
    if config.data.images:
        read_image_folder(config.data.images)  # the folder exists and holds an image; pixels are read in prepare


def _check_clip(spec: str) -> None:
    """`[eval] clip_model`, when local (or cached), must hold a transformers CLIP model's config.json."""
    path = model_dir("[eval] clip_model", spec)
    if path is None:
        return
    try:
        model_type = json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    if model_type != "clip":
        raise ValueError(f"[eval] clip_model = {spec!r} is not a transformers CLIPModel directory (its config.json "
                         "must say model_type \"clip\"); give one (save_pretrained), a hub id such as "
                         "openai/clip-vit-large-patch14, or leave it unset to skip the CLIP score")


def _check_feature_model(spec: str) -> None:
    """`[eval] feature_model`, when local (or cached), must hold a transformers model and its image processor."""
    path = model_dir("[eval] feature_model", spec)
    if path is None:
        return
    missing = [name for name in ("config.json", "preprocessor_config.json") if not (path / name).is_file()]
    if missing:
        raise ValueError(f"[eval] feature_model = {spec!r} lacks {' and '.join(missing)}: give a transformers CLIP "
                         "or DINOv2 directory saved with its image processor (save_pretrained of both), a hub id such "
                         "as facebook/dinov2-base, or leave it unset (the model-free pixel KID only)")
