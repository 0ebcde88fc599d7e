"""Quantization after pruning (paper 004 §4): linear fixed point, FP16, k-means codebooks.

Importing the package registers the file codecs (:mod:`unsparse.quant.codecs`) and the schemes' restorers,
which :func:`unsparse.load_sparse` needs to read quantized files.
"""

from unsparse.quant import codecs as codecs
from unsparse.quant.activations import ActivationSpec
from unsparse.quant.base import Quantizer
from unsparse.quant.fp16 import FP16Quantizer
from unsparse.quant.kmeans import KMeansQuantizer
from unsparse.quant.linear import LinearQuantizer
from unsparse.quant.none import NoQuantization

__all__ = ["ActivationSpec", "FP16Quantizer", "KMeansQuantizer", "LinearQuantizer", "NoQuantization", "Quantizer"]
