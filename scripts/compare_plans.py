"""Write two plans side by side (``unsparse.report.plan_comparison``): per layer key of one precision and layout, the
backend each plan chose and its median, slowest first, with the summed medians.

Example: ``python scripts/compare_plans.py before_plan.json after_plan.json --precision float32 --out compare.md``.
Plan files are untrusted input, read by ``Plan.load``: a malformed or unreadable one is refused in one line naming
the file (exit status 2). The page is written atomically.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from unsparse.atomic import atomic_write_text
from unsparse.report.plan_comparison import comparison_markdown, plan_rows
from unsparse.runtime.plan import Plan, PlanError
from unsparse.settings import output_file


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="the earlier plan (plan.json)")
    parser.add_argument("after", help="the later plan")
    parser.add_argument("--precision", default="float32", help="the keys' precision part, e.g. float32, float16, "
                        "float32+tf32")
    parser.add_argument("--layout", choices=("nchw", "nhwc"), default="nchw")
    parser.add_argument("--out", type=output_file, required=True, help="Markdown page to write")
    args = parser.parse_args(argv)
    try:
        rows = plan_rows(Plan.load(args.before), Plan.load(args.after), args.precision, args.layout)
    except (PlanError, OSError) as error:
        parser.error(str(error))
    if not rows:
        parser.error(f"no {args.precision} {args.layout} key in either plan")
    atomic_write_text(args.out, comparison_markdown(rows, Path(args.before).name, Path(args.after).name,
                                                          args.precision, args.layout))
    print(f"wrote {args.out}: {len(rows)} layer keys", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
