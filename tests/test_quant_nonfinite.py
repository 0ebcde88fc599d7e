"""NaN and infinite weights given to a scheme's own entry point (``quantize_values``) are refused with one message
that says what they are and how many, in every scheme; finite weights beyond a scheme's range keep their own."""

from __future__ import annotations

import re

import pytest
import torch

from unsparse import create_model, sparsify
from unsparse.quant import FP16Quantizer, KMeansQuantizer, LinearQuantizer
from unsparse.quant.activations import ActivationSpec

NAN, INF = float("nan"), float("inf")
NO_ACTIVATIONS = ActivationSpec(format="none")
SCHEMES = {
    "fp16": lambda: FP16Quantizer(activations=NO_ACTIVATIONS, progress=False),
    "linear": lambda: LinearQuantizer(bits=8, activations=NO_ACTIVATIONS, progress=False),
    "kmeans": lambda: KMeansQuantizer(clusters=4, n_init=1, max_iter=20, activations=NO_ACTIVATIONS, progress=False),
}
FEW = [0.5, -0.25, 0.0]
"""Fewer distinct weights than k-means' 4 clusters: it would take them as centroids without scikit-learn."""
MANY = torch.linspace(-1, 1, 12).tolist()
"""More distinct weights than 4 clusters: k-means would run scikit-learn, whose own message spoke of missing values."""


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize(("weights", "counts"), [
    ([NAN, *FEW], "1 NaN, of 4"),
    ([NAN, NAN, *MANY], "2 NaN, of 14"),
    ([NAN] * 3, "3 NaN, of 3"),  # every weight NaN: no saturation level or centroid to speak of
    ([INF, *FEW], "1 infinite, of 4"),
    ([-INF, *MANY], "1 infinite, of 13"),
    ([NAN, INF, -INF, *MANY], "1 NaN, 2 infinite, of 15"),
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_non_finite_weights_are_refused_as_such_and_counted(scheme, weights, counts, dtype):
    """FP16 called a NaN a weight beyond float16's range ('|w| >= 65520'); linear fixed point named a histogram
    argument 'x' the caller never gave; k-means reported a NaN saturation level, or scikit-learn's message."""
    values = torch.tensor(weights, dtype=dtype).reshape(1, -1)
    with pytest.raises(ValueError, match=rf"^non-finite weights \({re.escape(counts)}\); quantization needs finite "
                                         "ones$"):
        SCHEMES[scheme]().quantize_values(values)


@pytest.mark.parametrize(("weights", "counts"), [([NAN, *FEW], "1 NaN, of 4"),
                                                  ([INF, NAN, *MANY], "1 NaN, 1 infinite, of 14")])
def test_kmeans_clustering_called_directly_refuses_non_finite_weights_alike(weights, counts):
    """``cluster`` returned a NaN centroid for few distinct weights and gave scikit-learn's message for many."""
    with pytest.raises(ValueError, match=rf"^non-finite weights \({re.escape(counts)}\); quantization needs finite "
                                         "ones$"):
        SCHEMES["kmeans"]().cluster(torch.tensor(weights, dtype=torch.float64))


@pytest.mark.parametrize("weight", [70000.0, -65520.0])
def test_fp16_still_refuses_finite_weights_beyond_its_range_as_such(weight):
    values = torch.tensor([[weight, 1.0, 0.0]])
    with pytest.raises(ValueError, match=r"^weights exceed float16's range \(1 of 3 with \|w\| >= 65520, which "
                                         r"rounds to infinity\)$"):
        SCHEMES["fp16"]().quantize_values(values)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_finite_weights_still_quantize(scheme):
    values = torch.tensor([[*MANY, 0.0]])
    quantized, _ = SCHEMES[scheme]().quantize_values(values)
    assert quantized.dtype == torch.float32 and bool(torch.isfinite(quantized).all())
    assert float(quantized[0, -1]) == 0.0


@pytest.mark.parametrize("scheme", SCHEMES)
def test_a_models_non_finite_weights_are_counted_naming_the_layer(scheme):
    torch.manual_seed(0)
    model = sparsify(create_model("vgg_small", width=4).eval())
    values = model.get_submodule("3.0").values
    with torch.no_grad():
        values[0, :2] = NAN
        values[1, 0] = -INF
    with pytest.raises(ValueError, match=rf"^3\.0\.values: non-finite weights \(2 NaN, 1 infinite, of "
                                         rf"{values.numel()}\); quantization needs finite ones$"):
        SCHEMES[scheme]().quantize(model)
    assert not hasattr(model, "unsparse_quantization")
