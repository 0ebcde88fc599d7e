"""Quantization's checks of a file's description and codecs quote the values they read from it cut to 200
characters plus their length (:func:`unsparse.messages.quote`): a megabyte metadata string or list came back
whole in the error message."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch

from unsparse import create_model, sparsify
from unsparse.quant import ActivationSpec, KMeansQuantizer, LinearQuantizer
from unsparse.quant.codecs import CodebookCodec, FixedPointCodec
from unsparse.quant.kmeans import recorded_fit
from unsparse.quant.state import check_values_codecs, expected_values_codec
from unsparse.runtime import sparse_layers

HUGE = "x" * 1_000_000
HUGE_LIST = list(range(200_000))
MESSAGE_LIMIT = 600
"""Longest message allowed: its own words, and each quoted value at most 200 characters and its length."""


def kmeans_description(**weights) -> dict:
    return {"scheme": "kmeans", "weights": {**KMeansQuantizer(progress=False).settings(), **weights},
            "activations": {"format": "fp16"}}


def a_model_whose_codec_is(codec: dict) -> torch.nn.Module:
    model = sparsify(create_model("vgg_small", width=4).eval())
    next(iter(sparse_layers(model).values())).unsparse_codecs = {"values": codec}
    return model


def codec_decode(codec, **params) -> Callable[[], object]:
    return lambda: codec.decode({}, {"name": codec.name, **params}, (2, 3), "0.0.values")


CASES = {
    "state: unknown scheme": lambda: expected_values_codec({"scheme": HUGE}),
    "state: a layer's codec": lambda: check_values_codecs(a_model_whose_codec_is({"name": HUGE})),
    "codecs: fixed-point step": codec_decode(FixedPointCodec(), bits=8, step=HUGE),
    "codecs: codebook step": codec_decode(CodebookCodec(), index_bits=4, centroid_bits=8, step=HUGE_LIST),
    "codecs: bits": codec_decode(FixedPointCodec(), bits=HUGE, step=0.5),
    "codecs: codebook shape": lambda: CodebookCodec().decode(
        dict.fromkeys(("indices", "centroids", "row_nnz"), torch.zeros(0, dtype=torch.uint8)),
        {"name": "codebook", "index_bits": 4, "centroid_bits": 8, "step": 0.5}, tuple(HUGE_LIST), "0.0.values"),
    "description: unexpected key": lambda: LinearQuantizer.described({"scheme": "linear", HUGE: 1}),
    "description: weights": lambda: LinearQuantizer.described({"scheme": "linear", "weights": HUGE}),
    "description: unexpected setting": lambda: KMeansQuantizer.described(kmeans_description(**{HUGE: 1})),
    "description: recorded setting": lambda: KMeansQuantizer.described(kmeans_description(index_bits=HUGE_LIST)),
    "kmeans record: scheme": lambda: recorded_fit({"scheme": HUGE}),
    "activations: not an object": lambda: ActivationSpec.from_dict(HUGE_LIST),
    "activations: unknown key": lambda: ActivationSpec.from_dict({"format": "fp16", HUGE: 1}),
}


@pytest.mark.parametrize("case", CASES)
def test_values_read_from_a_file_are_quoted_short_with_their_length(case):
    with pytest.raises((ValueError, TypeError)) as caught:
        CASES[case]()
    message = str(caught.value)
    assert len(message) < MESSAGE_LIMIT, message[:MESSAGE_LIMIT]
    assert re.search(r"\.\.\. \(\d{6,} characters\)", message), message


def test_short_values_are_still_quoted_whole():
    with pytest.raises(ValueError, match=r"^quantization: unknown scheme 'ternary'; known: "):
        expected_values_codec({"scheme": "ternary"})
    with pytest.raises(ValueError, match=r"^0\.0\.values: step must be a float32 value > 0, got 0\.1$"):
        codec_decode(FixedPointCodec(), bits=8, step=0.1)()
    with pytest.raises(TypeError, match=r"^activations: unexpected \['colour'\], expected fields of \["):
        ActivationSpec.from_dict({"format": "fp16", "colour": 1})
