"""The video evaluation's figures against explicit computations: motion (a frozen student reads 0), the pixel
judge's features of a video, and the grid of videos laid out frame by frame."""

import torch

from dmd2.eval_set import image_grid
from dmd2.families.wan.evaluation import motion, video_features, video_grid
from dmd2.metrics import pixel_features


def test_motion_is_the_mean_change_between_consecutive_frames_and_zero_for_a_frozen_video():
    videos = torch.rand(2, 3, 4, 6, 6, generator=torch.Generator().manual_seed(0)) * 2 - 1
    changes = [(videos[n, :, f + 1] - videos[n, :, f]).abs().mean() for n in range(2) for f in range(3)]
    assert abs(motion(videos) - torch.stack(changes).mean().item()) < 1e-6
    frozen = videos[:, :, :1].expand(-1, -1, 4, -1, -1)
    assert motion(frozen) == 0.0 and motion(videos[:, :, :1]) == 0.0


def test_a_videos_features_are_its_strip_frames_pixel_features_side_by_side():
    videos = torch.rand(3, 3, 5, 8, 8, generator=torch.Generator().manual_seed(1))
    expected = torch.cat([pixel_features(videos[:, :, f]) for f in range(5)], dim=1)  # 5 frames: all in the strip
    assert torch.equal(video_features(videos), expected)


def test_the_video_grid_is_each_frames_picture_grid():
    videos = torch.rand(4, 3, 2, 4, 4, generator=torch.Generator().manual_seed(2)) * 2 - 1
    grid = video_grid(videos, columns=2)
    assert grid.shape[0] == 2
    for f in range(2):
        assert (grid[f] == image_grid(videos[:, :, f], 2)).all()
