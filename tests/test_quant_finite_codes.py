"""Integer codes, histograms and codecs refuse NaN and infinite values with the counted message the quantizers give
(``non-finite <what> (<n> NaN, <m> infinite, of <total>); ...``), naming no argument the caller never sees."""

from __future__ import annotations

import re

import pytest
import torch

from unsparse.quant.codecs import CodebookCodec, FixedPointCodec
from unsparse.quant.fixed_point import fixed_point_step, to_codes
from unsparse.quant.histogram import MagnitudeHistogram, saturation_level

NAN, INF = float("nan"), float("inf")
CASES = [([NAN, 0.5, 0.0], "1 NaN, of 3"), ([INF, 0.5], "1 infinite, of 2"),
         ([NAN, -INF, INF, 0.25], "1 NaN, 2 infinite, of 4")]


@pytest.mark.parametrize(("values", "counts"), CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_integer_codes_refuse_values_that_are_not_finite(values, counts, dtype):
    """A NaN became code -2^63 (an int64 has no NaN) without complaint, and ±inf a saturated code as if finite."""
    with pytest.raises(ValueError, match=rf"^non-finite values \({re.escape(counts)}\); integer codes need finite "
                                         "ones$"):
        to_codes(torch.tensor(values, dtype=dtype), fixed_point_step(1.0, 8), 8)


@pytest.mark.parametrize(("codec", "params"), [(FixedPointCodec(), {"bits": 8}),
                                               (CodebookCodec(), {"index_bits": 4, "centroid_bits": 8})])
def test_codecs_name_a_nan_as_such_not_as_off_the_grid(codec, params):
    """The encoders reported a NaN as 'the tensor is not on the 8-bit grid', sending the caller to quantize it."""
    step = fixed_point_step(1.0, 8)
    tensor = torch.tensor([[NAN, step, 0.0]])
    with pytest.raises(ValueError, match=rf"^{codec.name} codec: non-finite values \(1 NaN, of 3\); integer codes need "
                                         "finite ones$"):
        codec.encode(tensor, {**params, "step": step})


@pytest.mark.parametrize(("values", "counts"), CASES)
def test_histograms_count_values_that_are_not_finite(values, counts):
    """``saturation_level`` and ``MagnitudeHistogram.add`` said 'x: NaN or infinite values', naming an argument the
    caller never sees, unlike the quantizers' counted message."""
    pattern = rf"^non-finite values \({re.escape(counts)}\); a saturation level needs finite ones$"
    with pytest.raises(ValueError, match=pattern):
        saturation_level(torch.tensor(values), 0.99, 16)
    histogram = MagnitudeHistogram(1.0, 4)
    with pytest.raises(ValueError, match=pattern):
        histogram.add(torch.tensor(values))
    assert not bool(histogram.counts.any())


def test_finite_values_still_give_their_codes():
    step = fixed_point_step(1.0, 8)
    assert torch.equal(to_codes(torch.tensor([1.0, -1.0, 0.0, 3.0]), step, 8), torch.tensor([127, -127, 0, 127]))
