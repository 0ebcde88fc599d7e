"""torchvision's ImageNet architectures by name, randomly initialised (no weights are downloaded)."""

from __future__ import annotations

import torchvision
from torch import nn

from unsparse.models.registry import register_model


@register_model
def vgg16(num_classes: int = 1000) -> nn.Module:
    """torchvision VGG16 (13 3x3 convs); input ``(N, 3, 224, 224)``."""
    return torchvision.models.vgg16(weights=None, num_classes=num_classes)


@register_model
def resnet50(num_classes: int = 1000) -> nn.Module:
    """torchvision ResNet-50 (bottleneck 1x1/3x3/1x1 convs); input ``(N, 3, 224, 224)``."""
    return torchvision.models.resnet50(weights=None, num_classes=num_classes)


@register_model
def alexnet(num_classes: int = 1000) -> nn.Module:
    """torchvision AlexNet (11x11 stride 4 first conv); input ``(N, 3, 224, 224)``."""
    return torchvision.models.alexnet(weights=None, num_classes=num_classes)


@register_model
def googlenet(num_classes: int = 1000) -> nn.Module:
    """torchvision GoogLeNet (Inception v1, no auxiliary heads); input ``(N, 3, 224, 224)``."""
    return torchvision.models.googlenet(weights=None, num_classes=num_classes, aux_logits=False, init_weights=True)
