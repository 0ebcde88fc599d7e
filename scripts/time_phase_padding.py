"""Time the generated kernels' input of a strided layer, its padded float32 phase images, in one pass against two.

``padded_float32(x, padding, split)`` gathers the phase images (:class:`~unsparse.sparse.phases.PhaseSplit`) and pads
them in one ``pad_planes`` pass; before, the split's ``input`` copied ``x`` into its phase images and ``pad_planes``
then padded that copy. Both are timed in the same run on the inputs of strided layers of the benchmark's models (a
plain copy of the input for scale) and checked equal. Prints one JSON object (ms medians of CUDA-event timings after
warm-up).

    PYTHONPATH=. python3 scripts/time_phase_padding.py --batch 128 --runs 50
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

LAYERS = {"resnet50.conv1": ((3, 224, 224), 7, 2, 3), "alexnet.features.0": ((3, 224, 224), 11, 4, 2),
          "resnet50.layer2.0.downsample.0": ((256, 56, 56), 1, 2, 0),
          "resnet50.layer2.0.conv2": ((128, 56, 56), 3, 2, 1)}
"""Input ``(C, H, W)``, kernel size, stride and padding of strided layers of the benchmark's models."""


def passes(x: Any, split: Any, padding: tuple[int, int]) -> dict[str, Callable[[], Any]]:
    """The formulations timed on input ``x`` of a layer whose phase split is ``split``: a plain copy, the split's
    copy padded after, and the gather-and-pad pass."""
    from unsparse.runtime.backends.generated import padded_float32

    return {"copy": lambda: x.clone(), "two_passes": lambda: padded_float32(split.input(x), padding),
            "one_pass": lambda: padded_float32(x, padding, split)}


def main() -> None:
    """Parse arguments, time both formulations per layer and dtype, print the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    from unsparse.job import git_commit
    from unsparse.runtime.bench import environment, require_cuda
    from unsparse.runtime.timing import time_fn
    from unsparse.sparse import ConvGeometry, UniformCSR
    from unsparse.sparse.phases import phase_split

    require_cuda("time_phase_padding.py")

    device = torch.device("cuda")
    records = []
    for dtype in (torch.float32, torch.float16):
        for layer, (chw, kernel, stride, padding) in LAYERS.items():
            weight = torch.randn(8, chw[0], kernel, kernel)
            split = phase_split(UniformCSR.from_dense(weight), ConvGeometry.of(stride, padding))
            x = torch.randn(args.batch, *chw, device=device, dtype=dtype)
            formulations = passes(x, split, split.geometry.padding)
            assert torch.equal(formulations["one_pass"](), formulations["two_passes"]()), layer
            for name, fn in formulations.items():
                median = time_fn(lambda i, fn=fn: fn(), device, runs=args.runs).median_ms
                records.append({"layer": layer, "dtype": str(dtype), "formulation": name, "median_ms": median})
            del x, formulations
            torch.cuda.empty_cache()
    print(json.dumps({"environment": environment(git_commit()), "batch": args.batch, "records": records}, indent=1))


if __name__ == "__main__":
    main()
