"""The one message for values that are not all finite (NaN or infinite), wherever quantization meets them.

Quantization is defined on finite values only (paper 004 §4: eq. 19-21 map a value to a code; Alg. 3 clusters
weights): a NaN has no code or cluster, and an infinity has no saturation level. Each entry point refuses such
values with the same counted message, so a caller learns what they are and how many, not a symptom further on.
"""

from __future__ import annotations

import torch


def check_finite(values: torch.Tensor, what: str, needs: str) -> None:
    """Refuse ``values`` that are not all finite, counting each kind.

    Args:
        values: any shape and float dtype.
        what: what the values are, for the message (``"weights"``, ``"values"``).
        needs: what needs them finite, with its verb (``"quantization needs"``, ``"integer codes need"``).

    Raises:
        ValueError: ``non-finite <what> (<n> NaN, <m> infinite, of <total>); <needs> finite ones``, each count given
            where it is nonzero.
    """
    if bool(torch.isfinite(values).all()):  # one reduction where all is well; the kinds are counted only to refuse
        return
    nan = int(torch.isnan(values).sum())
    infinite = int(torch.isinf(values).sum())
    counts = ", ".join(f"{count} {kind}" for count, kind in ((nan, "NaN"), (infinite, "infinite")) if count)
    raise ValueError(f"non-finite {what} ({counts}, of {values.numel()}); {needs} finite ones")


def check_finite_weights(values: torch.Tensor) -> None:
    """Refuse weights that are not all finite, counting each kind: the one message every scheme gives for them.

    Without it each scheme failed further on with a message about something else: FP16 called a NaN a weight
    beyond float16's range, linear fixed point named a histogram argument ``x``, and k-means reported a NaN
    saturation level (or scikit-learn's own message).

    Args:
        values: weights of any shape and float dtype.

    Raises:
        ValueError: ``non-finite weights (<n> NaN, <m> infinite, of <total>); quantization needs finite ones``
            (:func:`check_finite`).
    """
    check_finite(values, "weights", "quantization needs")
