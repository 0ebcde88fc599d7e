"""Reports: per-layer tables (JSON, Markdown) and PNG plots."""

from unsparse.report.document import markdown_table, timing_verdicts, write_report
from unsparse.report.layers import layer_rows

__all__ = ["layer_rows", "markdown_table", "timing_verdicts", "write_report"]
