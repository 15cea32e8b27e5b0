import numpy as np
import pytest

from dmd2.media import frame_strip, is_video, strip_frames


def test_pictures_and_videos_are_told_apart():
    assert not is_video(np.zeros((8, 8), np.uint8))
    assert not is_video(np.zeros((8, 8, 3), np.uint8))
    assert is_video(np.zeros((5, 8, 8, 3), np.uint8))


def test_strip_frames_keep_the_first_and_last_and_space_the_rest():
    assert strip_frames(5, most=8) == [0, 1, 2, 3, 4]
    assert strip_frames(81, most=5) == [0, 20, 40, 60, 80]


def test_a_frame_strip_lays_the_frames_left_to_right_with_borders():
    rng = np.random.default_rng(0)
    video = rng.integers(1, 255, size=(3, 4, 6, 3), dtype=np.uint8)
    strip = frame_strip(video, border=2)
    assert strip.shape == (4 + 4, 3 * (6 + 2) + 2, 3)
    for i in range(3):
        left = 2 + i * 8
        assert np.array_equal(strip[2:6, left:left + 6], video[i])
    assert strip[:2].max() == 0 and strip[:, :2].max() == 0  # the border is black
    with pytest.raises(ValueError, match="F x H x W x C"):
        frame_strip(video[0])
