import numpy as np

from infra.tracking.video import write_mp4


def test_an_mp4_holds_every_frame_close_to_its_pixels(tmp_path):
    import av

    # smooth frames (H.264 is lossy on noise): a gradient moving one column a frame
    columns = np.arange(32)[None, :] * 6
    video = np.stack([np.broadcast_to(((columns + 4 * f) % 200)[:, :, None] + 20, (16, 32, 3))
                      for f in range(5)]).astype(np.uint8)
    path = write_mp4(video, tmp_path / "v.mp4")
    with av.open(str(path)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(frames) == 5
    assert all(frame.shape == (16, 32, 3) for frame in frames)
    error = np.abs(np.stack(frames).astype(float) - video.astype(float)).mean()
    assert error < 6, error


def test_odd_sides_are_padded_to_even(tmp_path):
    import av

    path = write_mp4(np.full((2, 5, 7, 3), 128, np.uint8), tmp_path / "odd.mp4")
    with av.open(str(path)) as container:
        assert [f.to_ndarray(format="rgb24").shape[:2] for f in container.decode(video=0)] == [(6, 8), (6, 8)]
