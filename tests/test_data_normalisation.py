"""Input normalisation does not depend on the CPU thread count (deterministic GPU runs start from it)."""

from __future__ import annotations

import torch

from unsparse.data import mean_and_std


def test_mean_and_std_round_alike_at_every_thread_count() -> None:
    """A Fashion-MNIST-sized training set (55,000 images of 28x28): float32 sums over it round differently at 3 to
    12 threads than at 1, 2 or 16; ``mean_and_std`` gives the same bits at each count, within float32 rounding of
    the float64 values."""
    values = torch.rand(55_000, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    try:
        results = set()
        for count in (1, 2, 3, 8, 16):
            torch.set_num_threads(count)
            mean, std = mean_and_std(values)
            assert mean.dtype == std.dtype == torch.float32 and mean.dim() == std.dim() == 0
            results.add((mean.item(), std.item()))
    finally:
        torch.set_num_threads(threads)
    assert len(results) == 1
    (mean, std), = results
    wide = values.double()
    assert abs(mean - wide.mean().item()) <= 2**-24 and abs(std - wide.std().item()) <= 2**-24
