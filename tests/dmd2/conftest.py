import pytest
import torch
from torch import nn


class TinyVelocity(nn.Module):
    """A small conditional velocity model: per-class affine map of x plus a sigma term."""

    def __init__(self, num_classes: int = 11, channels: int = 1, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.embed = nn.Embedding(num_classes, channels)
        self.sigma_scale = nn.Parameter(torch.randn(channels))

    def forward(self, x_s, sigma, cond):
        bias = self.embed(cond["class_labels"])[:, :, None, None]
        return self.conv(x_s) + bias + sigma[:, None, None, None] * self.sigma_scale[None, :, None, None]


@pytest.fixture
def tiny():
    return TinyVelocity()
