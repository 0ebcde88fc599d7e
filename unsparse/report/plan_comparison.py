"""Two plans side by side, layer key by layer key: which backend each chose and its measured median, so that a change
between two runs (a new kernel setting, a fusion) shows where the time moved, not only in the whole-model total.

A plan (:class:`~unsparse.runtime.plan.Plan`) holds, per layer key, the winner of the comparator's per-layer timing
and its median (ms); the end-to-end runs write one beside their result. The comparison reads the keys of one precision
and layout (:func:`plan_rows`) and writes them as a Markdown table (:func:`comparison_markdown`), slowest first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from unsparse.report.document import markdown_table
from unsparse.runtime.plan import Plan, key_layout


@dataclass(frozen=True)
class PlanRow:
    """One layer key in either plan.

    Attributes:
        layer: the key without its GPU name and precision (input and weight shapes, stride, padding, epilogue, ...).
        before_backend, after_backend: the backend each plan chose (None where the plan lacks the key).
        before_ms, after_ms: its median (ms; None where the plan lacks the key or the median was not measured).
    """

    layer: str
    before_backend: str | None
    before_ms: float | None
    after_backend: str | None
    after_ms: float | None

    @property
    def speedup(self) -> float | None:
        """``before_ms / after_ms`` (above 1: the layer got faster), None without both medians."""
        if self.before_ms is None or self.after_ms is None or self.after_ms <= 0:
            return None
        return self.before_ms / self.after_ms


def _median(plan: Plan, key: str) -> tuple[str | None, float | None]:
    entry = plan.get(key)
    if entry is None:
        return None, None
    return entry.backend, None if math.isnan(entry.median_ms) else entry.median_ms  # NaN: not measured


def plan_rows(before: Plan, after: Plan, precision: str, layout: str = "nchw") -> list[PlanRow]:
    """The keys of ``precision`` (the key's second part: ``"float32"``, ``"float32+tf32"``, ``"float16"``, ...) and
    ``layout`` (``"nchw"`` or ``"nhwc"``, :func:`~unsparse.runtime.plan.key_layout`) in either plan, slowest first by
    the later plan's median (then the earlier one's; keys without one last).

    Raises:
        ValueError: for a layout other than ``"nchw"`` or ``"nhwc"``.
    """
    if layout not in ("nchw", "nhwc"):
        raise ValueError(f"layout: expected 'nchw' or 'nhwc', got {layout!r}")
    keys = {key for plan in (before, after) for key in plan.entries
            if key.split("|")[1:2] == [precision] and key_layout(key) == layout}
    rows = [PlanRow(key.split("|", 2)[2], *_median(before, key), *_median(after, key)) for key in keys]
    return sorted(rows, key=lambda row: (row.after_ms is None, -(row.after_ms or 0.0), -(row.before_ms or 0.0),
                                         row.layer))


def comparison_markdown(rows: list[PlanRow], before_name: str, after_name: str, precision: str, layout: str) -> str:
    """A Markdown page: the summed medians of each plan over the keys both hold, then one row per key (backend and
    median in each plan, and before / after; the key's ``|`` escaped, as a table cell needs)."""
    both = [row for row in rows if row.before_ms is not None and row.after_ms is not None]
    before_total = sum(row.before_ms for row in both)
    after_total = sum(row.after_ms for row in both)
    lines = [f"# Plans compared: {precision}, {layout}", "",
             f"Before: `{before_name}`. After: `{after_name}`. Each median is the winner's in the comparator's "
             "per-layer timing of that run (ms); before / after above 1: the layer got faster.", "",
             f"Summed over the {len(both)} keys both plans time: {before_total:.3f} ms before, {after_total:.3f} ms "
             "after" + (f" ({before_total / after_total:.3f}x)." if after_total > 0 else "."), ""]
    header = ("layer", "before backend", "before ms", "after backend", "after ms", "before / after")
    lines.append(markdown_table(header, [("`" + row.layer.replace("|", "\\|") + "`", row.before_backend, row.before_ms,
                                          row.after_backend, row.after_ms, row.speedup) for row in rows]))
    return "\n".join(lines) + "\n"
