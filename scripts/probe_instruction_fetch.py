"""Probe: does an SM's instruction fetch slow down when the other SMs of its GPC run different code?

v31's shared kernels (``kernels/NOTES.md``, thirty-first session) run one program per SM (``smid % G``), and ncu
put 40 % of their stall samples on "no instruction", against 2.5 % for v27's kernels, where every SM runs the same
body. This probe separates the two explanations: a cache shared by the SMs of a GPC (then programs mapped per GPC
keep the fetch rate) or one per SM (then no mapping helps).

1. Which SMs share a GPC: a kernel with a compile-time cluster of 8 blocks records each block's ``%smid``; the
   blocks of one cluster always run on one GPC, so the SMs seen together are joined (union-find) into groups, each
   within one GPC. Several blocks of a cluster can share an SM, so a group may be part of a GPC only (the H200 run
   of the thirty-first session found 11 groups of 8-18 SMs for its 8 GPCs).
2. The fetch rate: a kernel of ``G`` loop bodies of :data:`BODY` FFMAs each (128 KB, beyond the SM's instruction
   cache, as a generated body of about 150 KB is), where each block runs the body its SM's table entry names.
   Mappings: every SM body 0 (one body on the GPU), ``smid % G``, and per group (group k runs body k % G), for each
   G of :data:`PROGRAMS`. Rates are FFMA warp instructions per ns per SM (peak: 4 schedulers x clock),
   CUDA events, median of ``--runs`` after warm-up.

Writes ``instruction_fetch.json`` under ``--out``.

    PYTHONPATH=. python3 scripts/probe_instruction_fetch.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

BODY = 8192
"""FFMAs per loop body (16 bytes each: 128 KB)."""

PROGRAMS = (2, 4, 8)
"""Distinct bodies per kernel (G)."""

CLUSTER = 8
"""Blocks per cluster of the GPC kernel (the portable maximum)."""

TABLE_SIZE = 1024
"""Entries of the SM table (``%smid`` is below ``%nsmid``, at most a few hundred on current GPUs)."""

GPC_SOURCE = r"""
extern "C" __global__ void __cluster_dims__(CLUSTER, 1, 1) where_am_i(unsigned int* out) {
    if (threadIdx.x == 0) {
        unsigned int sm, cluster;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(cluster));
        out[2 * blockIdx.x] = sm;
        out[2 * blockIdx.x + 1] = cluster;
    }
    long long start = clock64();
    while (clock64() - start < 200000) {
    }
}
""".replace("CLUSTER", str(CLUSTER))
"""Records ``(smid, cluster index)`` per block; the blocks stay resident about 0.1 ms so that the clusters spread."""


def gpc_groups(samples: list[tuple[int, int]]) -> list[list[int]]:
    """The SMs that share a GPC, from ``(smid, cluster)`` samples: SMs seen in one cluster are joined.

    Returns:
        Sorted lists of SM ids, one per group, sorted by their smallest id.
    """
    parent: dict[int, int] = {}

    def root(sm: int) -> int:
        while parent.setdefault(sm, sm) != sm:
            parent[sm] = parent[parent[sm]]
            sm = parent[sm]
        return sm

    first: dict[int, int] = {}
    for sm, cluster in samples:
        parent[root(sm)] = root(first.setdefault(cluster, sm))
    groups: dict[int, list[int]] = {}
    for sm in parent:
        groups.setdefault(root(sm), []).append(sm)
    return sorted((sorted(group) for group in groups.values()), key=lambda group: group[0])


def sm_table(mapping: str, programs: int, groups: list[list[int]]) -> np.ndarray:
    """``(TABLE_SIZE,)`` uint32: the body each SM runs under ``mapping`` (``same``, ``smid`` or ``gpc``).

    Raises:
        ValueError: for another mapping.
    """
    table = np.zeros(TABLE_SIZE, np.uint32)
    if mapping == "smid":
        table[:] = np.arange(TABLE_SIZE) % programs
    elif mapping == "gpc":
        for index, group in enumerate(groups):
            table[group] = index % programs
    elif mapping != "same":
        raise ValueError(f"mapping: expected same, smid or gpc, got {mapping!r}")
    return table


def ffma_loops_ptx(entry: str, params: str, registers: str, dispatch: list[str], bodies: list[np.ndarray]) -> str:
    """PTX of a kernel ``entry`` whose threads loop ``iterations`` times over one of ``bodies``, each a run of FFMAs
    with immediate operands (``uint32`` bit patterns of float32 weights) on 64 independent accumulators, then store
    the sum of their accumulators to ``out`` (float32, one per thread). PTX, not CUDA C, so that the bodies are
    assembled as written (NVVM spent 89 s on a 16 K body in C, ptxas 1.4 s).

    Args:
        entry: the kernel's name. params: its parameters after ``out`` and ``iterations``, each with its leading
            comma (or empty). registers: further ``.u32`` registers, each with its leading comma (or empty).
        dispatch: instructions after the loop count is loaded that branch to ``START<g>`` for body g; with none,
            every thread runs body 0.
    """
    lines = [".version 8.0", ".target sm_90", ".address_size 64",
             f".visible .entry {entry}(.param .u64 out, .param .u32 iterations{params}) {{",
             "  .reg .f32 %a<64>;", "  .reg .f32 %b, %s;", f"  .reg .u32 %i, %n, %t, %nt, %index{registers};",
             "  .reg .pred %p;", "  .reg .u64 %ptr, %off;",
             "  mov.u32 %t, %tid.x;", "  cvt.rn.f32.u32 %b, %t;", "  mul.f32 %b, %b, 0f38D1B717;"]
    lines += [f"  add.f32 %a{j}, %b, 0f{np.float32(j).view(np.uint32):08X};" for j in range(64)]
    lines += ["  ld.param.u32 %n, [iterations];", *dispatch]
    for g, weights in enumerate(bodies):
        lines += [f"START{g}:", "  mov.u32 %i, 0;", f"LOOP{g}:", "  setp.ge.u32 %p, %i, %n;", "  @%p bra DONE;"]
        lines += [f"  fma.rn.f32 %a{i % 64}, %a{i % 64}, 0f{weight:08X}, %b;" for i, weight in enumerate(weights)]
        lines += ["  add.u32 %i, %i, 1;", f"  bra LOOP{g};"]
    lines += ["DONE:", "  mov.f32 %s, %a0;"]
    lines += [f"  add.f32 %s, %s, %a{j};" for j in range(1, 64)]
    lines += ["  mov.u32 %index, %ctaid.x;", "  mov.u32 %nt, %ntid.x;", "  mad.lo.u32 %index, %index, %nt, %t;",
              "  mul.wide.u32 %off, %index, 4;", "  ld.param.u64 %ptr, [out];", "  add.u64 %ptr, %ptr, %off;",
              "  st.global.f32 [%ptr], %s;", "  ret;", "}"]
    return "\n".join(lines) + "\n"


def fetch_source(programs: int, body: int = BODY) -> str:
    """PTX of ``fetch(out, iterations, table)`` (:func:`ffma_loops_ptx`): ``programs`` loops of ``body`` FFMAs
    (different immediates per body), the block's loop chosen by ``table[%smid]``."""
    rng = np.random.default_rng(body)
    dispatch = ["  mov.u32 %sm, %smid;", f"  min.u32 %sm, %sm, {TABLE_SIZE - 1};", "  mul.wide.u32 %off, %sm, 4;",
                "  ld.param.u64 %ptr, [table];", "  add.u64 %ptr, %ptr, %off;", "  ld.global.u32 %program, [%ptr];"]
    dispatch += [f"  setp.eq.u32 %p, %program, {g};\n  @%p bra START{g};" for g in range(1, programs)]
    bodies = [rng.uniform(0.4, 0.6, body).astype(np.float32).view(np.uint32) for _ in range(programs)]
    return ffma_loops_ptx("fetch", ", .param .u64 table", ", %sm, %program", dispatch, bodies)


def find_gpcs(launches: int = 8) -> tuple[list[list[int]], int]:
    """Run the cluster kernel ``launches`` times over ``CLUSTER`` x (SMs) blocks.

    Returns:
        The GPC groups (:func:`gpc_groups`) and the number of blocks whose ``%clusterid.x`` disagreed with
        ``blockIdx.x / CLUSTER`` (0 where the compile-time cluster was honoured).
    """
    import cupy
    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    function = cupy.RawModule(code=GPC_SOURCE, options=("-arch=sm_90",)).get_function("where_am_i")
    blocks = CLUSTER * sms
    samples: list[tuple[int, int]] = []
    mismatched = 0
    for launch in range(launches):
        out = cupy.zeros(2 * blocks, dtype=cupy.uint32)
        function((blocks,), (128,), (out,))
        pairs = out.get().reshape(blocks, 2)
        mismatched += int(np.sum(pairs[:, 1] != np.arange(blocks) // CLUSTER))
        samples += [(int(sm), launch * blocks + block // CLUSTER) for block, (sm, _) in enumerate(pairs)]
    return gpc_groups(samples), mismatched


def fetch_rates(groups: list[list[int]], runs: int) -> list[dict[str, Any]]:
    """FFMA issue rate per SM for each G of :data:`PROGRAMS` and each mapping, with every SM given 8 blocks of 256
    threads (64 warps in flight, register-limited to fewer)."""
    import cupy
    import torch

    from unsparse.runtime.timing import time_fn

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    out = cupy.empty(sms * 8 * 256, dtype=cupy.float32)
    iterations = 256
    records = []
    folder = Path(tempfile.mkdtemp())
    for programs in PROGRAMS:
        path = folder / f"fetch_{programs}.ptx"
        path.write_text(fetch_source(programs))
        kernel = cupy.RawModule(path=str(path)).get_function("fetch")
        for mapping in ("same", "smid", "gpc"):
            table = cupy.asarray(sm_table(mapping, programs, groups))
            timing = time_fn(lambda _, k=kernel, t=table: k((sms * 8,), (256,), (out, np.int32(iterations), t)),
                             torch.device("cuda"), runs=runs, warmup=2)
            warp_instructions = sms * 8 * 8 * BODY * iterations
            records.append({"programs": programs, "mapping": mapping, "median_ms": timing.median_ms,
                            "ffma_warp_instructions_per_ns_per_sm": warp_instructions / timing.median_ms / 1e6 / sms})
            print(json.dumps(records[-1]), flush=True)
    return records


def main() -> None:
    """Find the GPCs, time every (G, mapping), and write ``instruction_fetch.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    from unsparse.atomic import atomic_write_text
    from unsparse.runtime.bench import require_cuda

    require_cuda("probe_instruction_fetch.py")
    import cupy
    import torch

    properties = torch.cuda.get_device_properties(0)
    groups, mismatched = find_gpcs()
    print(json.dumps({"gpcs": [len(group) for group in groups], "cluster_mismatches": mismatched}), flush=True)
    result = {"environment": {"gpu": properties.name, "sms": properties.multi_processor_count,
                              "driver": cupy.cuda.runtime.driverGetVersion(), "torch": torch.__version__,
                              "cupy": cupy.__version__, "python": platform.python_version()},
              "commit": args.commit, "body_instructions": BODY, "body_bytes": 16 * BODY, "runs": args.runs,
              "gpc_groups": groups, "cluster_mismatches": mismatched,
              "records": fetch_rates(groups, args.runs)}
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "instruction_fetch.json", json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
