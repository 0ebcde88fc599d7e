"""Generator of ``kernels/window_dispatch.cuh``: the per-nonzero jump tables of ``direct_window``.

``direct_window`` keeps, per lane, a ``PY x PX`` output block of ``MW`` output channels (accumulators) and
the block's ``(PY + R - 1) x (PX + S - 1)`` input window of one input channel in registers. A nonzero
``w = W[m, c, r, s]`` with ``m = group * MW + j`` then adds ``w * window[py + r][px + s]`` to
``acc[j][py][px]`` for every ``(py, px)``: ``PY * PX`` FMAs whose register operands depend on the code
``j * R * S + r * S + s`` (Escoin, paper 000 §3.1: the stretched offset of a tap, here resolved into
registers instead of addresses).

Registers cannot be indexed at run time, and NVVM lowers a 72-case ``switch`` to a compare tree (about 22 %
of the issued instructions are FMAs; kernels/NOTES.md, 2026-11-23). This module writes one inline-PTX block
per shape instead: a ``.branchtargets`` table over every code, one ``brx.idx`` on the code and, per code,
the ``PY * PX`` ``fma.rn.f32`` on operands bound to the C++ accumulators and window: one indirect jump per
nonzero. The table is text the compiler cannot derive from a template, so it is generated here and the
header is committed; ``tests/test_runtime_window.py`` checks that the committed header equals this output.

    python -c "from unsparse.runtime.window_dispatch import main; main()"   # rewrite the header
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from unsparse.atomic import atomic_write_text

HEADER_PATH = Path(__file__).resolve().parents[2] / "kernels" / "window_dispatch.cuh"


@dataclass(frozen=True)
class WindowShape:
    """One jump table: kernel ``R x S``, lane block ``PY x PX`` output pixels, ``MW`` output channels."""

    r: int
    s: int
    py: int
    px: int
    mw: int

    @property
    def codes(self) -> int:
        """Entries of the table, ``MW * R * S`` (a nonzero's code is ``j * R * S + r * S + s``)."""
        return self.mw * self.r * self.s

    @property
    def window_hw(self) -> tuple[int, int]:
        """Input window of a lane, ``(PY + R - 1, PX + S - 1)`` elements."""
        return self.py + self.r - 1, self.px + self.s - 1

    def accumulators(self) -> int:
        """float32 partial sums per lane, ``MW * PY * PX``."""
        return self.mw * self.py * self.px


WINDOW_SHAPES = (
    WindowShape(3, 3, 2, 4, 8),
    WindowShape(3, 3, 2, 4, 4),
)
"""Shapes with a generated table: 3x3 kernels, 2x4 pixels per lane, 8 or 4 output channels per warp (64 or
32 accumulators; with the 24-element window, 90 or 58 asm operands)."""


def shape_of(kernel_size: tuple[int, int], py: int, px: int, mw: int) -> WindowShape:
    """The generated :class:`WindowShape` for a kernel size and lane block.

    Raises:
        ValueError: if no table was generated for it.
    """
    shape = WindowShape(kernel_size[0], kernel_size[1], py, px, mw)
    if shape not in WINDOW_SHAPES:
        raise ValueError(f"window: no jump table for {shape}; generated: {list(WINDOW_SHAPES)}")
    return shape


def _operands(shape: WindowShape) -> tuple[list[str], list[str]]:
    outputs = [f'"+f"(a[{j}][{py}][{px}])' for j in range(shape.mw) for py in range(shape.py)
               for px in range(shape.px)]
    wh, ww = shape.window_hw
    inputs = [f'"f"(v[{i}][{q}])' for i in range(wh) for q in range(ww)] + ['"f"(w)', '"r"(code)']
    return outputs, inputs


def _table(shape: WindowShape) -> list[str]:
    """PTX lines of the jump table, operands numbered outputs first (as GCC-style asm numbers them)."""
    wh, ww = shape.window_hw
    first_window = shape.accumulators()
    weight = first_window + wh * ww
    code = weight + 1
    labels = [f"$Lc{k}" for k in range(shape.codes)]
    lines = [f"$Ltab: .branchtargets {', '.join(labels)};", f"brx.idx %{code}, $Ltab;"]
    for k, label in enumerate(labels):
        j, rest = divmod(k, shape.r * shape.s)
        r, s = divmod(rest, shape.s)
        lines.append(f"{label}:")
        for py in range(shape.py):
            for px in range(shape.px):
                acc = (j * shape.py + py) * shape.px + px
                window = first_window + (py + r) * ww + (px + s)
                lines.append(f"fma.rn.f32 %{acc}, %{weight}, %{window}, %{acc};")
        lines.append("bra.uni $Lend;")
    lines.append("$Lend:")
    return lines


def specialisation(shape: WindowShape) -> str:
    """C++ source of ``WindowDispatch<R, S, PY, PX, MW>`` for one shape."""
    wh, ww = shape.window_hw
    outputs, inputs = _operands(shape)
    body = "\n".join(f'        "{line}\\n"' for line in ["{", *_table(shape), "}"])
    return (f"template <>\n"
            f"struct WindowDispatch<{shape.r}, {shape.s}, {shape.py}, {shape.px}, {shape.mw}> {{\n"
            f"  static constexpr int codes = {shape.codes};\n"
            f"  __device__ __forceinline__ static void apply(float (&a)[{shape.mw}][{shape.py}][{shape.px}],\n"
            f"                                               const float (&v)[{wh}][{ww}], float w, int code) {{\n"
            f"    asm(\n{body}\n"
            f"        : {', '.join(outputs)}\n"
            f"        : {', '.join(inputs)});\n"
            f"  }}\n"
            f"}};\n")


def header() -> str:
    """The whole text of ``kernels/window_dispatch.cuh``."""
    parts = [
        "// Generated by unsparse/runtime/window_dispatch.py (main()); do not edit.",
        "//",
        "// WindowDispatch<R, S, PY, PX, MW>::apply(acc, window, w, code) adds w * window[py + r][px + s] to",
        "// acc[j][py][px] for all (py, px), where code = j * R * S + r * S + s, through one brx.idx jump.",
        "// The caller guarantees 0 <= code < codes (validated on the host before launch and clamped in the kernel).",
        "#pragma once",
        "",
        "template <int R, int S, int PY, int PX, int MW>",
        "struct WindowDispatch;",
        "",
    ]
    return "\n".join(parts) + "\n" + "\n".join(specialisation(shape) for shape in WINDOW_SHAPES)


def main() -> None:
    """Write :data:`HEADER_PATH`."""
    atomic_write_text(HEADER_PATH, header())


if __name__ == "__main__":
    main()
