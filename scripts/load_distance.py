"""How far ahead of their first use the ``generated`` kernels' loads are scheduled, from the compiled SASS, on the CPU.

For chosen conv layers of a torchvision model with synthetic weights magnitude-pruned to a stated sparsity
(``bench.pruned_layers``) and chosen settings (``rows``, ``programs``, ``load_batch``, ``min_blocks``), every kernel
source of the setting, as the backend lists it (``GeneratedBackend.kernel_sources``: one per program, or with
``programs`` > 1 one per group of programs, whose bodies share the kernel's registers), is compiled for sm_90 with
the local ``nvcc -cubin -Xptxas -v`` (the registers ptxas gives it) and disassembled with ``cuobjdump -sass``; per
kernel (its ``program`` field: the index in that list) the record holds the registers, the counts of LDG and FFMA
instructions and of all instructions, and the load-to-use distance: for each LDG, the instructions until the first
one that reads its destination register (median and mean over the kernel's loads). With one loaded value feeding a
few FMAs, the distance is what hides the load's latency: ResNet-50's layer2.1.conv2 at 0.9 ran a program of distance
about 70 in half the time of its siblings at about 12, at the same instruction count (``kernels/NOTES.md``,
sixty-second session). The NVRTC of the GPU machine and this nvcc are both CUDA 13.0; their registers agreed on that
layer.

Writes ``load_distance.json`` and ``load_distance.md`` under ``--out`` (atomically).

    PYTHONPATH=. python scripts/load_distance.py --layers layer2.1.conv2 --settings '{"rows": 32}' \\
        '{"rows": 32, "load_batch": 16}' '{"rows": 32, "min_blocks": 4}' '{"rows": 32, "programs": 4}' \\
        --out build/distance
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from unsparse.atomic import atomic_write_text
from unsparse.runtime import bench
from unsparse.runtime.backends import get_backend
from unsparse.settings import generated_setting_argument
from unsparse.sparse.format import UniformCSR

SETTING_KEYS = ("rows", "programs", "load_batch", "min_blocks")
"""What a ``--settings`` entry may set (:func:`~unsparse.settings.generated_setting_argument`); ``rows`` is required,
``programs`` is 1 unless given (more: the kernels of several programs, ``generated_conv_shared``)."""


def sass_instructions(sass: str) -> list[str]:
    """The instructions of ``cuobjdump -sass`` text, in order, without their addresses, predicates or ``;``."""
    found = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", sass)
    return [re.sub(r"^@!?U?P\w+\s+", "", instruction) for instruction in found]


def _registers(text: str) -> set[str]:
    """The general registers ``R<n>`` named in ``text`` (suffixes such as ``.reuse`` or ``.64`` dropped)."""
    return set(re.findall(r"\bR(\d+)\b", text))


def load_distances(instructions: list[str], readers: tuple[str, ...] = ("FFMA",)) -> list[int]:
    """For each LDG in ``instructions`` (straight-line order), how many instructions later its destination register
    is first read, where that first reader's opcode starts with one of ``readers`` (default: a product of the body;
    the epilogue's bias and residual loads, v64, feed additions and would otherwise swamp a short body's few
    loads); an LDG whose register is overwritten first, never read, or first read by another instruction is left
    out."""
    distances = []
    for index, instruction in enumerate(instructions):
        load = re.match(r"LDG\S*\s+R(\d+)", instruction)
        if load is None:
            continue
        register = load.group(1)
        for later in range(index + 1, len(instructions)):
            opcode, _, operands = instructions[later].partition(" ")
            fields = [field.strip() for field in operands.split(",")]
            reads = operands if opcode.startswith(("ST", "BRA", "RET", "EXIT")) else ", ".join(fields[1:])
            if register in _registers(reads):
                if opcode.startswith(readers):
                    distances.append(later - index)
                break
            if fields and register in _registers(fields[0]):
                break
    return distances


def ptxas_registers(log: str) -> int:
    """The registers per thread of the last ``ptxas info : Used N registers`` line of ``log``.

    Raises:
        ValueError: if ``log`` has no such line.
    """
    found = re.findall(r"Used (\d+) registers", log)
    if not found:
        raise ValueError("ptxas log: no 'Used N registers' line")
    return int(found[-1])


def compile_program(source: str, folder: Path, name: str, nvcc: str, cuobjdump: str) -> dict[str, Any]:
    """Compile one kernel source for sm_90 and measure its SASS: ``registers``, ``ldg``, ``ffma``,
    ``instructions``, ``distance_median`` and ``distance_mean`` (instructions).

    Raises:
        RuntimeError: naming the tool, if nvcc or cuobjdump fails.
    """
    path, cubin = folder / f"{name}.cu", folder / f"{name}.cubin"
    path.write_text(source)
    built = subprocess.run([nvcc, "-arch=sm_90", "-cubin", "-std=c++17", "-Xptxas", "-v", str(path), "-o",
                            str(cubin)], capture_output=True, text=True)
    if built.returncode:
        raise RuntimeError(f"nvcc failed on {name}: {built.stderr[-2000:]}")
    dumped = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True)
    if dumped.returncode:
        raise RuntimeError(f"cuobjdump failed on {name}: {dumped.stderr[-2000:]}")
    instructions = sass_instructions(dumped.stdout)
    distances = load_distances(instructions)
    return {"registers": ptxas_registers(built.stderr),
            "ldg": sum(instruction.startswith("LDG") for instruction in instructions),
            "ffma": sum(instruction.startswith("FFMA") for instruction in instructions),
            "instructions": len(instructions),
            "distance_median": statistics.median(distances) if distances else None,
            "distance_mean": statistics.fmean(distances) if distances else None}


def find_cuobjdump() -> str | None:
    """``cuobjdump`` on the PATH, else the one Triton's wheel bundles, else None."""
    found = shutil.which("cuobjdump")
    if found is None:
        try:
            import triton
        except ImportError:
            return None
        bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        found = str(bundled) if bundled.is_file() else None
    return found


def markdown(records: list[dict[str, Any]]) -> str:
    """One row per layer, setting and program."""
    lines = ["| layer | setting | program | registers | LDG | FFMA | instructions | distance median | distance mean |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        mean = "-" if r["distance_mean"] is None else f"{r['distance_mean']:.1f}"
        lines.append(f"| {r['layer']} | {json.dumps(r['setting'])} | {r['program']} | {r['registers']} | {r['ldg']} | "
                     f"{r['ffma']} | {r['instructions']} | {r['distance_median']} | {mean} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model", choices=bench.MODELS, default="resnet50")
    parser.add_argument("--layers", nargs="+", required=True, help="conv module names, as in the model")
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--settings", nargs="+", type=functools.partial(generated_setting_argument, keys=SETTING_KEYS),
                        default=[{"rows": 32}])
    parser.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    parser.add_argument("--nvcc", default=shutil.which("nvcc"))
    parser.add_argument("--cuobjdump", default=find_cuobjdump())
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    if args.nvcc is None or args.cuobjdump is None:
        parser.error("needs nvcc and cuobjdump (on the PATH, or --nvcc / --cuobjdump)")
    try:
        layers = bench.pruned_layers(args.model, args.sparsity, args.layers)
    except ValueError as error:
        parser.error(f"--layers: {error}")
    backend = get_backend("generated")
    dtype = getattr(torch, args.dtype)
    jobs = []
    for name in args.layers:
        layer = layers[name]
        csr = UniformCSR.from_dense(layer.weight.to(dtype))
        x = torch.empty(1, *layer.in_chw, dtype=dtype)  # the sources hold no batch size
        for setting in args.settings:
            sources = backend.kernel_sources(x, csr, layer.geometry, [{"programs": 1, **setting}])
            jobs += [({"layer": name, "setting": setting, "program": index}, source)
                     for index, (source, _) in enumerate(sources)]
    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(args.workers) as pool:
        measured = list(pool.map(lambda job: compile_program(job[1][1], Path(folder), f"k{job[0]}", args.nvcc,
                                                             args.cuobjdump), enumerate(jobs)))
    records = [{**key, **figures} for (key, _), figures in zip(jobs, measured, strict=True)]
    result = {"model": args.model, "sparsity": args.sparsity, "weights": "synthetic, magnitude-pruned",
              "dtype": args.dtype, "nvcc": subprocess.run([args.nvcc, "--version"], capture_output=True,
                                                          text=True).stdout.strip().splitlines()[-1],
              "records": records}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "load_distance.json", json.dumps(result, indent=1))
    atomic_write_text(args.out / "load_distance.md", markdown(records))
    print(markdown(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
