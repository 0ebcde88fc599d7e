"""Small CNN families for 28x28 single-channel images (Fashion-MNIST; sklearn digits upsampled).

Both end in global average pooling, so any input size of at least 8x8 works.
"""

from __future__ import annotations

from torch import nn

from unsparse.models.registry import register_model


def conv_bn_relu(in_channels: int, out_channels: int, stride: int = 1) -> nn.Sequential:
    """3x3 convolution (padding 1, no bias) + BatchNorm + ReLU."""
    return nn.Sequential(nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False),
                         nn.BatchNorm2d(out_channels), nn.ReLU(inplace=True))


@register_model
def vgg_small(num_classes: int = 10, in_channels: int = 1, width: int = 32) -> nn.Module:
    """VGG-style CNN: [w, w] pool [2w, 2w] pool [4w, 4w], global average pool, linear classifier.

    Input ``(N, in_channels, H, W)`` float32; output ``(N, num_classes)`` logits.
    """
    w = width
    plan = [(in_channels, w), (w, w), "pool", (w, 2 * w), (2 * w, 2 * w), "pool", (2 * w, 4 * w), (4 * w, 4 * w)]
    layers: list[nn.Module] = [nn.MaxPool2d(2) if step == "pool" else conv_bn_relu(*step) for step in plan]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * w, num_classes))


class BasicBlock(nn.Module):
    """ResNet basic block: two 3x3 convs with a residual; a 1x1 projection when the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(conv_bn_relu(in_channels, out_channels, stride),
                                  nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False),
                                  nn.BatchNorm2d(out_channels))
        self.shortcut = nn.Identity() if stride == 1 and in_channels == out_channels else nn.Sequential(
            nn.Conv2d(in_channels, out_channels, 1, stride, bias=False), nn.BatchNorm2d(out_channels))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.relu(self.body(x) + self.shortcut(x))


@register_model
def resnet_small(num_classes: int = 10, in_channels: int = 1, width: int = 32) -> nn.Module:
    """ResNet-style CNN: stem conv, three stages of one basic block (w, 2w stride 2, 4w stride 2), pool, linear.

    Input ``(N, in_channels, H, W)`` float32; output ``(N, num_classes)`` logits.
    """
    w = width
    return nn.Sequential(conv_bn_relu(in_channels, w), BasicBlock(w, w, 1), BasicBlock(w, 2 * w, 2),
                         BasicBlock(2 * w, 4 * w, 2), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4 * w, num_classes))
