"""Generator of ``kernels/window_dispatch.cuh``: the nonzero loops of ``direct_window`` as PTX jump tables.

``direct_window`` keeps, per lane, a ``PY x PX`` output block of ``MW`` output channels (accumulators) and
the block's ``(PY + R - 1) x (PX + S - 1)`` input window of one input channel in registers. A nonzero
``w = W[m, c, r, s]`` with ``m = group * MW + j`` then adds ``w * window[py + r][px + s]`` to
``acc[j][py][px]`` for every ``(py, px)``: ``PY * PX`` FMAs whose register operands depend on the code
``j * R * S + r * S + s`` (Escoin, paper 000 §3.1: the stretched offset of a tap, here resolved into
registers instead of addresses).

Registers cannot be indexed at run time, and NVVM lowers a 72-case ``switch`` to a compare tree (about 22 %
of the issued instructions are FMAs; kernels/NOTES.md, 2026-11-23). A C++ loop around one ``brx.idx`` per
nonzero still spent 27 instructions per 8 FMAs (H100 profile, NOTES v5). This module writes the whole loop
over one (group, channel) list as one inline-PTX block, threaded code: a ``.branchtargets`` table over every
code plus an exit, and each entry of the table loads the next (code, weight), does its ``PY * PX``
``fma.rn.f32`` on operands bound to the C++ accumulators and window, and jumps on the next code. A list ends
with the sentinel code ``MW * R * S`` (the exit); codes are clamped to it (``min.u32``), so no value read
from memory can jump outside the table. The table is text the compiler cannot derive from a template, so it
is generated here and the header is committed; ``tests/test_runtime_window.py`` checks that the committed
header equals this output and parses the table back.

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
    WindowShape(3, 3, 4, 4, 4),
    WindowShape(3, 3, 2, 8, 4),
)
"""Shapes with a generated table: 3x3 kernels; 2x4 pixels per lane with 8 or 4 output channels per warp, or 4x4
and 2x8 pixels with 4 (64, 32, 64 and 64 accumulators; with the window, 89, 57, 101 and 105 asm operands)."""


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
    inputs = [f'"f"(v[{i}][{q}])' for i in range(wh) for q in range(ww)] + ['"l"(entries)']
    return outputs, inputs


def ptx_loop(shape: WindowShape) -> list[str]:
    """PTX lines of the threaded loop, operands numbered outputs first (as GCC-style asm numbers them):
    accumulators, window elements, then the pointer to the list's first (code, weight bits) pair."""
    wh, ww = shape.window_hw
    first_window = shape.accumulators()
    pointer = first_window + wh * ww
    labels = [f"$Lc{k}" for k in range(shape.codes)]
    jump = [f"min.u32 code, code, {shape.codes};", "brx.idx code, $Ltab;"]
    lines = [".reg .b32 code, weight, next_code, next_weight;", ".reg .b64 cursor;",
             f"mov.b64 cursor, %{pointer};", "ld.global.nc.v2.b32 {code, weight}, [cursor];",
             f"$Ltab: .branchtargets {', '.join(labels)}, $Lexit;", *jump]
    for k, label in enumerate(labels):
        j, rest = divmod(k, shape.r * shape.s)
        r, s = divmod(rest, shape.s)
        lines += [f"{label}:", "ld.global.nc.v2.b32 {next_code, next_weight}, [cursor+8];",
                  "add.s64 cursor, cursor, 8;"]
        for py in range(shape.py):
            for px in range(shape.px):
                acc = (j * shape.py + py) * shape.px + px
                window = first_window + (py + r) * ww + (px + s)
                lines.append(f"fma.rn.f32 %{acc}, weight, %{window}, %{acc};")
        lines += ["mov.b32 code, next_code;", "mov.b32 weight, next_weight;", *jump]
    lines.append("$Lexit:")
    return lines


def specialisation(shape: WindowShape) -> str:
    """C++ source of ``WindowDispatch<R, S, PY, PX, MW>`` for one shape."""
    wh, ww = shape.window_hw
    outputs, inputs = _operands(shape)
    body = "\n".join(f'        "{line}\\n"' for line in ["{", *ptx_loop(shape), "}"])
    return (f"template <>\n"
            f"struct WindowDispatch<{shape.r}, {shape.s}, {shape.py}, {shape.px}, {shape.mw}> {{\n"
            f"  static constexpr int codes = {shape.codes};\n"
            f"  __device__ __forceinline__ static void run(float (&a)[{shape.mw}][{shape.py}][{shape.px}],\n"
            f"                                             const float (&v)[{wh}][{ww}], const int2* entries) {{\n"
            f"    asm volatile(\n{body}\n"
            f"        : {', '.join(outputs)}\n"
            f"        : {', '.join(inputs)});\n"
            f"  }}\n"
            f"}};\n")


def header() -> str:
    """The whole text of ``kernels/window_dispatch.cuh``."""
    parts = [
        "// Generated by unsparse/runtime/window_dispatch.py (main()); do not edit.",
        "//",
        "// WindowDispatch<R, S, PY, PX, MW>::run(acc, window, entries) walks the (code, weight bits) pairs from",
        "// entries up to the sentinel code `codes`, adding weight * window[py + r][px + s] to acc[j][py][px] for",
        "// all (py, px), code = j * R * S + r * S + s: one brx.idx jump per nonzero (threaded code).",
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
