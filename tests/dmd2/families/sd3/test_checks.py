"""The sd3 family's checks (dmd2/families/sd3/checks.py) of `[data] images` (the folder, and the GAN's need of it)
and of `[eval] feature_model`."""

import pytest

from dmd2.config import ConfigError, config_from_dict
from dmd2.families.sd3.checks import check


def recipe(sd3_dir, tmp_path, images="", critic_gan_weight=0.0):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a photo of a cat\n")
    return config_from_dict({"model": {"family": "sd3", "teacher": str(sd3_dir)},
                             "data": {"prompts": str(prompts), "images": str(images) if images else ""},
                             "dmd2": {"critic_gan_weight": critic_gan_weight}})


def test_a_folder_with_an_image_and_the_gan_weight_passes(sd3_dir, tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "cat.PNG").write_bytes(b"pixels are read in prepare, not here")
    check(recipe(sd3_dir, tmp_path, tmp_path / "real", critic_gan_weight=0.01))


@pytest.mark.parametrize("folder, files, critic_gan_weight, message", [
    ("missing", None, 0.01, r"\[data\] images .*missing: is not a folder; give a folder of images"),
    ("empty", {"cat.txt": "a cat", "notes.md": "", "sub/dog.png": ""}, 0.01,
     r"\[data\] images .*empty: holds no image \(files ending in \.png, \.jpg, \.jpeg, \.webp; subfolders"),
    (None, None, 0.01, (r"\[dmd2\] critic_gan_weight = 0\.01 needs real images for the GAN's discriminator: set "
                        r"\[data\] images to a folder .*or set critic_gan_weight = 0 and gan_weight = 0")),
    ("real", {"cat.png": ""}, 0.0, (r"\[data\] images is read only by the GAN's discriminator: set \[dmd2\] "
                                    r"critic_gan_weight > 0 .*or remove \[data\] images")),
])
def test_the_checks_refuse_a_bad_folder_and_either_of_gan_and_images_alone(sd3_dir, tmp_path, folder, files,
                                                                            critic_gan_weight, message):
    for name, text in (files or {}).items():
        (tmp_path / folder / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / name).write_text(text)
    config = recipe(sd3_dir, tmp_path, folder and tmp_path / folder, critic_gan_weight)
    with pytest.raises(ConfigError, match=message):
        check(config)


def test_a_feature_model_directory_needs_its_image_processor(sd3_dir, tmp_path):
    from tests.dmd2.families.sd3.tiny_pipeline import build_tiny_dinov2

    features = build_tiny_dinov2(tmp_path / "dinov2")
    check(recipe(sd3_dir, tmp_path).replace("eval", feature_model=str(features)))
    check(recipe(sd3_dir, tmp_path).replace("eval", feature_model="builtin:digits"))
    (features / "preprocessor_config.json").unlink()
    with pytest.raises(ConfigError, match=r"\[eval\] feature_model = .*dinov2' lacks preprocessor_config\.json: give"):
        check(recipe(sd3_dir, tmp_path).replace("eval", feature_model=str(features)))
