"""Activation quantization at the input of every sparse convolution (paper 004 §4), as fake quantization.

Each :class:`unsparse.runtime.SparseConv` gets a child module ``input_quantizer`` and a forward pre-hook that
passes the layer's input through it, so the convolution sees activations on the chosen grid while the
arithmetic stays float32 (on the CPU; FP16/INT kernels belong to the GPU runtime). Formats:

- ``fp16``: round to the nearest float16 (the 16b activations of the paper's 16b/16b configuration), once from any
  float dtype (:func:`~unsparse.quant.float16.to_float16`). Magnitudes beyond float16's range (``|x| >= 65520``,
  infinities included) saturate to ``±65504``, its largest value, as the ``fixed`` format saturates at its level,
  instead of overflowing to infinity, which would turn the rest of the network into infinities and NaN; for an
  input on the CPU, a warning names the layer and the count, once per layer (on another device counting would
  read a number back to the host at every layer: each forward would wait for the GPU, and a CUDA-graph capture
  of the model would fail, so there the values saturate unreported). (A float16 GPU run would overflow there.)
- ``fixed``: signed ``bits``-bit fixed point (eq. 19-21, :mod:`unsparse.quant.fixed_point`) with the
  saturation level chosen by histogram analysis of calibration data (:mod:`unsparse.quant.histogram`),
  stored per layer as the buffer ``input_quantizer.saturation`` (float32 scalar, same unit as activations). The
  step is read from the buffer once per value it holds (at the first forward after calibration, a load or a move
  to another device), not at every forward: on a GPU each read waits for the device, and a CUDA-graph capture of
  the model fails on it; a capture after one eager forward holds no read.

On load, :meth:`unsparse.quant.layerwise.LayerwiseQuantizer.restore` rebuilds the structure from
:meth:`ActivationSpec.to_dict` (the restorer mechanism of :mod:`unsparse.quant.state`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, fields
from itertools import islice
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from unsparse.messages import quote
from unsparse.modes import eval_mode
from unsparse.quant.fixed_point import SMALLEST_STEP, check_bits, fake_quantize, fixed_point_step
from unsparse.quant.float16 import FLOAT16_MAX, FLOAT16_OVERFLOW, to_float16
from unsparse.quant.histogram import MagnitudeHistogram, check_bins
from unsparse.runtime.modules import sparse_layers
from unsparse.settings import check_choice, check_flag, check_integer, check_quantile
from unsparse.sparse.format import SparseFormatError

FORMATS = ("none", "fp16", "fixed")
SATURATION_RULES = ("quantile", "fraction_of_max")
"""How :attr:`ActivationSpec.quantile` gives a layer's saturation level (see :class:`ActivationSpec`)."""
MAX_CALIBRATION_BATCHES = 1 << 16
"""Most calibration batches: :func:`calibrate` keeps them all for its two passes (and a larger count than
``itertools.islice`` takes failed inside it, naming nothing)."""
SILENT_LEVEL = 1.0
"""Saturation level of a layer whose calibration inputs are all zero (:func:`calibrate`)."""
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ActivationSpec:
    """How the inputs of the sparse convolutions are quantized.

    Args:
        format: ``"none"`` (float32), ``"fp16"`` or ``"fixed"``.
        bits: fixed-point bits in ``[2, 16]`` (``fixed`` only).
        quantile: the saturation threshold in ``(0, 1]`` (``fixed``; paper 004 §4 sets 0.99), read by ``rule``.
        bins: histogram bins over ``[0, max |x|]``, in ``[1, 65536]``
            (:data:`~unsparse.quant.histogram.MAX_BINS`); the level is exact to ``max |x| / bins``.
        power_of_two: step as a power of two (eq. 21) instead of ``x_sat / q_max`` (eq. 20).
        calibration_batches: calibration batches used (the first ones of the loader), in
            ``[1, MAX_CALIBRATION_BATCHES]`` (65,536; :func:`calibrate` holds them all in memory).
        rule: how ``quantile`` gives the saturation level ``x_sat`` (:data:`SATURATION_RULES`): ``"quantile"``,
            that quantile of the nonzero ``|x|`` (the histogram analysis of §4); ``"fraction_of_max"``,
            ``quantile * max |x|`` (§4's sentence "values higher than 0.99 x_max are saturated to 0.99 x_max"
            read literally; the histogram then plays no part).

    Raises:
        ValueError: unknown format or rule, bits out of range, bad quantile/bins/batches.
    """

    format: str = "none"
    bits: int = 8
    quantile: float = 0.99
    bins: int = 2048
    power_of_two: bool = False
    calibration_batches: int = 4
    rule: str = "quantile"

    def __post_init__(self) -> None:
        check_choice(self.format, FORMATS, "activations.format")
        check_bits(self.bits, "activations.bits")
        check_quantile(self.quantile, "activations.quantile")
        check_bins(self.bins, "activations.bins")
        check_integer(self.calibration_batches, "activations.calibration_batches", 1, MAX_CALIBRATION_BATCHES)
        check_flag(self.power_of_two, "activations.power_of_two")
        check_choice(self.rule, SATURATION_RULES, "activations.rule")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (stored in the file's quantization description); only ``format`` unless fixed."""
        return asdict(self) if self.format == "fixed" else {"format": self.format}

    @classmethod
    def from_dict(cls, data: Any) -> ActivationSpec:
        """Inverse of :meth:`to_dict`: ``format`` must be there, and for ``fixed`` every field but ``rule`` (a
        description that lost one would otherwise fall back to a default and quantize differently; files written
        before ``rule`` existed used the quantile rule, its default).

        Raises:
            ValueError: ``data`` not an object (quoted, cut to 200 characters by
                :func:`~unsparse.messages.quote`: it may come from a file), a field missing, or one out of range
                (naming it).
            TypeError: keys that are no field, quoted the same way (the constructor's own message quoted a key in
                full).
        """
        if not isinstance(data, dict):
            raise ValueError(f"activations: expected an object, got {quote(data)}")
        names = sorted(f.name for f in fields(cls))
        unknown = sorted(map(str, set(data) - set(names)))
        if unknown:
            raise TypeError(f"activations: unexpected {quote(unknown)}, expected fields of {names}")
        # a description without "rule" was written before the field existed, by the quantile rule (the default)
        required = {f.name for f in fields(cls)} - {"rule"} if data.get("format") == "fixed" else {"format"}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"activations: missing {missing}")
        return cls(**data)


class ActivationQuantizer(nn.Module):
    """Fake-quantizes a tensor to ``spec``'s format; output has the input's shape and dtype.

    ``fixed`` needs :attr:`saturation` (``()`` float32 buffer, > 0) set by :func:`calibrate`. ``name`` (e.g.
    ``features.3.input_quantizer``) names the quantizer in the warning about fp16 saturation, given for inputs on
    the CPU (see the module docstring).
    """

    def __init__(self, spec: ActivationSpec, name: str = "input_quantizer") -> None:
        super().__init__()
        self.spec, self.name = spec, name
        self.saturation_logged = False
        self._step_of: tuple[torch.Tensor, int, float] | None = None
        if spec.format == "fixed":
            self.register_buffer("saturation", torch.zeros((), dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.spec.format == "fp16":
            if not self.saturation_logged and x.device.type == "cpu":  # elsewhere: no read-back (module docstring)
                beyond = int((x.abs() >= FLOAT16_OVERFLOW).sum())
                if beyond:
                    log.warning("%s: %d values beyond float16's range saturated to ±%s (further batches of this "
                                "layer are not reported)", self.name, beyond, FLOAT16_MAX)
                    self.saturation_logged = True
            # clamped in float16, after rounding: in x's dtype the bound need not exist (bfloat16 rounds it to 65536)
            return to_float16(x).clamp(-FLOAT16_MAX, FLOAT16_MAX).to(x.dtype)
        if self.spec.format == "fixed":
            return fake_quantize(x, self.step(), self.spec.bits).to(x.dtype)
        return x

    def step(self) -> float:
        """The ``fixed`` format's step ``Δ`` (eq. 20-21, :func:`fixed_point_step`) for the level :attr:`saturation`
        holds now, read back from its device only when the buffer is another tensor (moved, replaced) or was
        written in place (calibration, ``load_state_dict``) since the last call (module docstring).

        Raises:
            ValueError: from :func:`fixed_point_step` (e.g. an uncalibrated level of 0).
        """
        version = self.saturation._version
        if self._step_of is None or self._step_of[0] is not self.saturation or self._step_of[1] != version:
            step = fixed_point_step(float(self.saturation), self.spec.bits, self.spec.power_of_two)
            self._step_of = (self.saturation, version, step)
        return self._step_of[2]

    def check_loaded_state(self, name: str) -> None:
        """Called by file loading (:func:`~unsparse.sparse.io.load_sparse`) once the buffers hold the file's values:
        a ``fixed`` quantizer's saturation must give a usable step (:func:`fixed_point_step`).

        Raises:
            SparseFormatError: naming ``<name>.saturation``.
        """
        if self.spec.format == "fixed":
            try:
                self.step()
            except ValueError as error:
                raise SparseFormatError(f"{name}.saturation: {error}") from error

    def extra_repr(self) -> str:
        return f"format={self.spec.format!r}" + (f", bits={self.spec.bits}" if self.spec.format == "fixed" else "")


def _quantize_input(layer: nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    return (layer.input_quantizer(args[0]), *args[1:])


def attach_activation_quantizers(model: nn.Module, spec: ActivationSpec) -> dict[str, ActivationQuantizer]:
    """Give every SparseConv of ``model`` an ``input_quantizer`` and the pre-hook that applies it.

    Works on a ``meta``-device model (file loading): buffers are created uncalibrated, to be loaded.

    Returns:
        The quantizers by layer name (empty for format ``none``, which attaches nothing).
    """
    if spec.format == "none":
        return {}
    quantizers = {}
    for name, layer in sparse_layers(model).items():
        layer.input_quantizer = ActivationQuantizer(spec, f"{name}.input_quantizer")
        layer.register_forward_pre_hook(_quantize_input)
        quantizers[name] = layer.input_quantizer
    return quantizers


def _observe_inputs(model: nn.Module, batches: list[torch.Tensor], record: Callable[[str, torch.Tensor], None],
                    desc: str, progress: bool) -> None:
    """Run ``model`` on ``batches`` calling ``record(layer name, input)`` at every SparseConv."""
    handles = [layer.register_forward_pre_hook(lambda module, args, name=name: record(name, args[0]))
               for name, layer in sparse_layers(model).items()]
    try:
        for images in tqdm(batches, desc=desc, leave=False, disable=not progress):
            model(images)
    finally:
        for handle in handles:
            handle.remove()


@torch.no_grad()
def calibrate(model: nn.Module, calibration: Iterable[tuple[torch.Tensor, torch.Tensor]] | None,
              spec: ActivationSpec, progress: bool = True) -> dict[str, float]:
    """Saturation level of each SparseConv's input: the histogram analysis of paper 004 §4.

    Passes over the first ``spec.calibration_batches`` batches (model in eval mode, float32 activations; each module's
    own mode is put back afterwards; call it before :func:`attach_activation_quantizers`): the first finds ``max |x|``
    per layer; with ``spec.rule`` ``"fraction_of_max"`` the level is ``spec.quantile * max |x|`` (at least ``2^-149``,
    float32's smallest value), and with ``"quantile"`` a second pass fills a :class:`MagnitudeHistogram` over ``[0,
    max]`` and takes its ``spec.quantile`` level. Exact zeros (e.g. after a ReLU) are not counted: the quantile is over
    the nonzero magnitudes, so the level does not depend on the share of zeros (see :mod:`unsparse.quant.histogram`).

    Args:
        model: CPU model with SparseConv layers.
        calibration: batches ``(images (N, C, H, W) float32, labels)``.
        spec: rule, quantile, bins and number of batches.

    Returns:
        Saturation level per layer name (same unit as the activations). A layer whose calibration inputs are all
        zero (a fully pruned layer before it makes them so on any data) gets :data:`SILENT_LEVEL`, with a logged
        warning: any level quantizes zeros exactly.

    Raises:
        ValueError: no calibration batch, calibration images that are all zero, or a layer input that holds NaN or
            an infinity (naming the layer).
    """
    batches = [images for images, _ in islice(calibration or [], spec.calibration_batches)]
    if not batches:
        raise ValueError("calibration: fixed-point activations need at least one calibration batch")
    if not any(bool(images.any()) for images in batches):
        raise ValueError("calibration: every calibration image is zero; no saturation level can be measured")
    maxima = dict.fromkeys(sparse_layers(model), 0.0)

    def record_max(name: str, x: torch.Tensor) -> None:
        # Python's max would skip a NaN (NaN > m is false) and leave the layer looking all zero
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"calibration: the input of layer {name} holds NaN or infinite values; saturation levels "
                             "need finite activations")
        maxima[name] = max(maxima[name], float(x.abs().max()))

    with eval_mode(model):
        _observe_inputs(model, batches, record_max, "calibration: max |x|", progress)
        silent = sorted(name for name, upper in maxima.items() if upper <= 0)
        if silent:
            log.warning("calibration: every input of %s is zero (a fully pruned layer before it?); their saturation "
                        "level is set to %s, under which zeros stay exactly zero", ", ".join(silent), SILENT_LEVEL)
        levels = dict.fromkeys(silent, SILENT_LEVEL)
        if spec.rule == "fraction_of_max":
            # at least float32's smallest value: the float32 buffer rounds a fraction of a subnormal max to 0
            return {**levels, **{name: max(spec.quantile * upper, SMALLEST_STEP) for name, upper in maxima.items()
                                 if upper > 0}}
        histograms = {name: MagnitudeHistogram(upper, spec.bins) for name, upper in maxima.items() if upper > 0}

        def record_histogram(name: str, x: torch.Tensor) -> None:
            if name in histograms:
                histograms[name].add(x)

        _observe_inputs(model, batches, record_histogram, "calibration: histogram", progress)
    return {**levels, **{name: histogram.level(spec.quantile) for name, histogram in histograms.items()}}
