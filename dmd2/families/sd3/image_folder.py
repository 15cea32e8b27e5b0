"""The image folder of `[data] images`: the GAN discriminator's real images, each with its caption.

A folder's own files (not its subfolders) whose names end in .png, .jpg, .jpeg or .webp (any case) are
its images, in the order of their names; an image's caption is the text of the same-named `.txt` beside
it (`cat.png` -> `cat.txt`), else the empty prompt. Standard library only: the CLI lists and checks the
folder before anything heavy loads (dmd2/families/sd3/checks.py); the family reads it with the same
function (dmd2/families/sd3/real_images.py opens the pixels).
"""

from dataclasses import dataclass
from pathlib import Path

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")


@dataclass(frozen=True)
class RealImage:
    """One image of the folder and its caption ("" without a caption file)."""

    path: Path
    caption: str


def _images_error(path: Path, problem: str) -> ValueError:
    return ValueError(f"[data] images {path}: {problem}")


def _caption(image: Path) -> str:
    caption = image.with_suffix(".txt")
    if not caption.is_file():
        return ""
    try:
        return caption.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise _images_error(image.parent, f"the caption {caption.name} cannot be read as UTF-8 text ({error}); "
                                          "fix it or remove it (then the image's caption is the empty prompt)") from error


def read_image_folder(path: str | Path) -> list[RealImage]:
    """The folder's images, sorted by name, with their captions. A missing folder or one without an image
    is an error naming `[data] images` and the fix."""
    path = Path(path)
    if not path.is_dir():
        raise _images_error(path, "is not a folder; give a folder of images (png, jpg, jpeg or webp; a same-named "
                                  ".txt beside an image is its caption)")
    images = sorted((p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()),
                    key=lambda p: p.name)
    if not images:
        raise _images_error(path, f"holds no image (files ending in {', '.join(IMAGE_SUFFIXES)}; subfolders are "
                                  "not read); put the real images for the GAN's discriminator there")
    return [RealImage(image, _caption(image)) for image in images]
