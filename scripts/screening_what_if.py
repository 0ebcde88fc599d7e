"""Replay the comparator's screening of ``generated``'s dear settings on committed per-layer results
(``unsparse.report.screening``): per ratio, the layers that would skip their kernels of several programs and the wins
that would be lost. Prints JSON; with ``--estimates``, instead every estimate made before a build beside the
setting's full median (``estimate_errors``). A file that cannot be read or is not a result is refused in one line
naming it (exit status 2).

Example: ``python scripts/screening_what_if.py benchmarks/results/h200_*.json --ratios 1.1 1.2 1.3 1.5``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from unsparse.report.results import load_result
from unsparse.report.screening import estimate_errors, replay, screened_layers


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="bench.json results (.json or .json.xz)")
    parser.add_argument("--ratios", nargs="+", type=float, default=[1.1, 1.2, 1.3, 1.5])
    parser.add_argument("--estimates", action="store_true", help="list the estimates against full medians")
    args = parser.parse_args(argv)
    try:
        results = [(Path(path).name, load_result(path)) for path in sorted(args.results)]
    except (OSError, ValueError) as error:
        parser.error(str(error))
    if args.estimates:
        print(json.dumps(estimate_errors(results), indent=1))
        return 0
    layers = screened_layers(results)
    print(json.dumps([replay(layers, ratio) for ratio in args.ratios], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
