"""What a family's media are: uint8 pictures (H x W or H x W x C) or videos (F x H x W x C), and how a video is
shown where only pictures can be (a strip of its frames: MLflow's image gallery, the run's output folder).

NumPy only: the driver reads these without torch."""

import numpy as np

STRIP_FRAMES = 8  # a strip shows at most this many frames, evenly spaced: a glance at the motion, not the video
STRIP_BORDER = 2


def is_video(media: np.ndarray) -> bool:
    """Whether one of `Evaluation.media` is a video (F x H x W x C, C of 1, 3 or 4) rather than a picture."""
    return media.ndim == 4 and media.shape[-1] in (1, 3, 4)


def strip_frames(num_frames: int, most: int = STRIP_FRAMES) -> list[int]:
    """The frames a strip shows: all of them up to `most`, else `most` evenly spaced from the first to the last."""
    if num_frames <= most:
        return list(range(num_frames))
    return [round(i * (num_frames - 1) / (most - 1)) for i in range(most)]


def frame_strip(video: np.ndarray, most: int = STRIP_FRAMES, border: int = STRIP_BORDER) -> np.ndarray:
    """A video F x H x W x C as one picture: the frames of `strip_frames` side by side, left to right, with a black
    `border` around each: [H + 2b, n (W + b) + b, C]."""
    if not is_video(video):
        raise ValueError(f"a frame strip is made of a video F x H x W x C, got shape {video.shape}")
    frames = [video[i] for i in strip_frames(video.shape[0], most)]
    _, height, width, channels = video.shape
    strip = np.zeros((height + 2 * border, len(frames) * (width + border) + border, channels), dtype=video.dtype)
    for i, frame in enumerate(frames):
        left = border + i * (width + border)
        strip[border:border + height, left:left + width] = frame
    return strip
