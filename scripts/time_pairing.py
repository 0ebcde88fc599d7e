"""Time the image pairing of ``direct_tile``'s paired inputs against a plain copy of the same tensor, on CUDA.

Pairing re-lays ``(N, C, H, W)`` as ``(N/2, C, H, W, 2)`` inside every timed call of a float16 or paired float32
``tile`` setting (``pair_images_on_device``: the kernel on CUDA since v23, torch's ``pair_images`` before), so its
cost is part of those settings' times. A copy moves the same bytes; the gap is what
a faster pairing could save. Candidate formulations (torch's on a flattened view, and the ``pair_images`` kernel that
the direct backend launches on CUDA) are timed in the same run and checked equal to ``pair_images``.
Prints one JSON object (ms medians of CUDA-event timings after warm-up, and GB/s counting bytes read and written).

    PYTHONPATH=. python3 scripts/time_pairing.py --batch 128 --runs 20
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

SHAPES = {"features.2": (64, 224, 224), "features.7": (128, 112, 112), "features.10": (128, 56, 56),
          "features.12": (256, 56, 56)}
"""VGG16 layer inputs (C, H, W) whose settings were timed with paired inputs."""


def main() -> None:
    """Parse arguments, time each formulation per shape and dtype, print the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    if args.batch % 2:
        parser.error("--batch: the flattened formulation pairs whole images, so the batch must be even")
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from unsparse.job import git_commit
    from unsparse.runtime.backends.direct import pair_images, pair_images_on_device
    from unsparse.runtime.bench import environment, require_cuda
    from unsparse.runtime.timing import time_fn

    require_cuda("time_pairing.py")

    device = torch.device("cuda")
    formulations = {
        "copy": lambda x: x.clone(),
        "pair_images": pair_images,
        "kernel": pair_images_on_device,
        "flat_transpose": lambda x: x.view(x.shape[0] // 2, 2, -1).transpose(1, 2).contiguous()
        .view(x.shape[0] // 2, *x.shape[1:], 2),
    }
    records = []
    for dtype in (torch.float32, torch.float16):
        for layer, chw in SHAPES.items():
            x = torch.randn(args.batch, *chw, device=device, dtype=dtype)
            reference = pair_images(x)
            for name, fn in formulations.items():
                if name != "copy":
                    assert torch.equal(fn(x), reference), name
                median = time_fn(lambda i, fn=fn, x=x: fn(x), device, runs=args.runs).median_ms
                records.append({"layer": layer, "dtype": str(dtype), "formulation": name, "median_ms": median,
                                "gb_per_s": 2 * x.numel() * x.element_size() / median / 1e6})
            del x, reference
            torch.cuda.empty_cache()
    print(json.dumps({"environment": environment(git_commit()), "batch": args.batch, "records": records}, indent=1))


if __name__ == "__main__":
    main()
