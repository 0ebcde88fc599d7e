"""1D-CNN autoencoder of UnSparse-Opt §6.1 (paper 004): twelve Conv1d layers with kernels 3 and 1.

Six convolutions encode (kernel 3, 1, 3 stride 2, 1, 3 stride 2, 1) and six decode (nearest upsampling by 2
before the first and third), mirroring the anomaly-detection autoencoders the paper prunes on MSL.
"""

from __future__ import annotations

from torch import nn

from unsparse.models.registry import register_model


def conv1d_block(in_channels: int, out_channels: int, kernel_size: int, stride: int = 1,
                 activation: bool = True) -> nn.Sequential:
    """Conv1d (padding ``kernel_size // 2``), then BatchNorm1d + ReLU unless ``activation`` is False (bias then)."""
    conv = nn.Conv1d(in_channels, out_channels, kernel_size, stride, kernel_size // 2, bias=not activation)
    return nn.Sequential(conv, nn.BatchNorm1d(out_channels), nn.ReLU(inplace=True)) if activation else \
        nn.Sequential(conv)


@register_model
def autoencoder1d(channels: int = 1, width: int = 16, latent: int = 2) -> nn.Module:
    """Twelve-Conv1d autoencoder: input ``(N, channels, T)`` float32 with ``T`` divisible by 4, output the same.

    Encoder: ``channels -> w (k3) -> w (k1) -> 2w (k3, stride 2) -> 2w (k1) -> 2w (k3, stride 2) -> latent (k1,
    linear)``; the code is ``(N, latent, T/4)``. Decoder: upsample, ``2w (k3) -> 2w (k1)``, upsample,
    ``w (k3) -> w (k1) -> w (k3) -> channels (k1, linear)``.
    """
    w = width
    encoder = nn.Sequential(conv1d_block(channels, w, 3), conv1d_block(w, w, 1), conv1d_block(w, 2 * w, 3, 2),
                            conv1d_block(2 * w, 2 * w, 1), conv1d_block(2 * w, 2 * w, 3, 2),
                            conv1d_block(2 * w, latent, 1, activation=False))
    decoder = nn.Sequential(nn.Upsample(scale_factor=2), conv1d_block(latent, 2 * w, 3), conv1d_block(2 * w, 2 * w, 1),
                            nn.Upsample(scale_factor=2), conv1d_block(2 * w, w, 3), conv1d_block(w, w, 1),
                            conv1d_block(w, w, 3), conv1d_block(w, channels, 1, activation=False))
    return nn.Sequential(encoder, decoder)
