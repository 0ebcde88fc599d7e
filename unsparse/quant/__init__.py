"""Quantization after pruning (paper 004 §4): linear fixed point, FP16, k-means codebooks.

Importing the package registers the file codecs (:mod:`unsparse.quant.codecs`), which
:func:`unsparse.load_sparse` needs to read quantized files.
"""

from unsparse.quant import codecs as codecs
