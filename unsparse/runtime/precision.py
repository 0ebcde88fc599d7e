"""Benchmark precisions: storage dtype, TF32 permission for cuDNN and cuBLAS, and the sparse backend compared.

"FP32" means TF32 off in every library (the brief's benchmark protocol); a column says TF32 where it is on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Precision:
    """One benchmark precision: the storage dtype, whether cuDNN and cuBLAS may use TF32, and the sparse backend
    timed against them."""

    dtype: torch.dtype
    tf32: bool
    sparse: str = "direct"


PRECISIONS = {"fp32": Precision(torch.float32, False), "tf32": Precision(torch.float32, True),
              "fp16": Precision(torch.float16, False), "fp16_half2": Precision(torch.float16, False, "direct_half2"),
              "fp32_generated": Precision(torch.float32, False, "generated"),
              "tf32_generated": Precision(torch.float32, True, "generated"),
              "fp16_generated": Precision(torch.float16, False, "generated")}
"""Precision name -> :class:`Precision`. ``fp16_half2``: cuDNN FP16 against the half2-product kernel
(:class:`~unsparse.runtime.backends.direct.DirectHalf2Backend`), an opt-in change of numerics; ``fp16`` times the
direct kernels with float32 products. The ``*_generated`` precisions time the weight-specialised kernels
(:class:`~unsparse.runtime.backends.generated.GeneratedBackend`, float32 arithmetic) against the same cuDNN mode as
the precision without the suffix; they compile kernels per layer, so they are opt-in too."""

SPARSE_BACKENDS = tuple(sorted({mode.sparse for mode in PRECISIONS.values()}))
"""The sparse backends the precisions time (``direct``, ``direct_half2``, ``generated``): those a whole-model plan may
add to a precision's own (``run_bench``'s ``end_to_end_backends``)."""

DENSE_PRECISIONS = tuple(name for name, mode in PRECISIONS.items() if mode.sparse == "direct")
"""The precisions whose dense model is its own (fp32, tf32, fp16): the others differ from these only in the sparse
backend they time, so a script that times dense models alone offers these."""


@contextmanager
def precision_mode(tf32: bool) -> Iterator[None]:
    """Allow or forbid TF32 in cuDNN and cuBLAS for the duration; restores the previous flags."""
    saved = tf32_flags()
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def tf32_flags() -> tuple[bool, bool]:
    """``(torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)``, read through the C getters those
    two properties call: a planned layer's prepared call depends on them for a float32 CUDA input, so every forward
    reads them, and through the properties the two reads took 1.7 us on this project's CPU (0.2 us through the
    getters, forty-sixth session)."""
    return torch._C._get_cudnn_allow_tf32(), torch._C._get_cublas_allow_tf32()
