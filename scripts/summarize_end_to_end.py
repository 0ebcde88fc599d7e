"""Write one page of whole-model results across benchmark runs (``unsparse.report.end_to_end_summary``): the planned
sparse model in its faster layout against the best dense model of its run, per end-to-end record.

Example: ``python scripts/summarize_end_to_end.py benchmarks/results/h200_*_end_to_end_*.json
--out docs/end_to_end_summary.md``. Files without end-to-end records add no row; a file that cannot be read or is
not a result is refused in one line naming it (exit status 2). The page is written atomically.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from unsparse.atomic import atomic_write_text
from unsparse.report.end_to_end_summary import summary_markdown, summary_rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", help="bench.json results (.json or .json.xz)")
    parser.add_argument("--out", required=True, help="Markdown page to write")
    args = parser.parse_args(argv)
    try:
        rows = summary_rows(sorted(args.results))
    except (OSError, ValueError) as error:
        parser.error(str(error))
    if not rows:
        parser.error("no end-to-end record in the results given")
    names = " ".join(shlex.quote(path) for path in sorted(args.results))
    command = f"python scripts/summarize_end_to_end.py {names} --out {shlex.quote(args.out)}"
    atomic_write_text(Path(args.out), summary_markdown(rows, command))
    print(f"wrote {args.out}: {len(rows)} rows", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
