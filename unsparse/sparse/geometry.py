"""Convolution geometry: stride, padding, dilation, groups, output sizes and stretched offsets.

Conv1d is handled as Conv2d over an input of height 1 (``R = 1``, stride/padding/dilation 1/0/1 along H).
"""

from __future__ import annotations

import operator
from dataclasses import asdict, dataclass

import torch
from torch import nn

from unsparse.messages import quote
from unsparse.sparse.format import SIZE_LIMIT, SparseFormatError


def _integers(value: object) -> tuple[int, ...]:
    """``value`` (an integer, or a tuple or list of them) as a tuple; ``()`` for anything else (``operator.index``:
    a float is refused, not truncated; so is a bool)."""
    values = tuple(value) if isinstance(value, tuple | list) else (value,)
    if any(_is_bool(item) for item in values):  # True is an int to Python, not a size
        return ()
    try:
        return tuple(map(operator.index, values))
    except TypeError:
        return ()


def _is_bool(value: object) -> bool:
    """A Python, numpy or torch boolean (each of which ``operator.index`` reads as 0 or 1)."""
    return isinstance(value, bool) or type(value).__name__ == "bool_" or (
        isinstance(value, torch.Tensor) and value.dtype == torch.bool)


def _integer(value: object, name: str) -> int:
    """``value`` as a Python int (a numpy or torch integer converted), or ``SparseFormatError`` naming ``name``."""
    values = _integers(value)
    if isinstance(value, tuple | list) or len(values) != 1:
        raise SparseFormatError(f"{name}: expected an integer, got {quote(value)}")
    return values[0]


def _per_dimension(value: int | tuple[int, ...] | list[int], name: str, dims: int) -> tuple[int, ...]:
    """``value`` for each of ``dims`` dimensions: an integer or a one-element sequence for all of them, as
    ``F.conv1d``/``F.conv2d`` read it, or ``dims`` integers."""
    values = _integers(value)
    values = values * dims if len(values) == 1 else values
    if len(values) != dims:
        raise SparseFormatError(f"{name}: expected an integer, or {'one' if dims == 1 else f'one or {dims}'} of "
                                f"them, got {quote(value)}")
    return values


def _resolve_padding(padding: str, kernel_size: tuple[int, ...] | None, stride: int | tuple[int, ...],
                     dilation: int | tuple[int, ...]) -> int | tuple[int, ...]:
    """``'valid'`` as 0, ``'same'`` as per-dimension integers (see :meth:`ConvGeometry.of`)."""
    if padding not in ("valid", "same"):
        raise SparseFormatError(f"padding: {padding!r}, expected 'valid', 'same' or integers")
    if padding == "valid":
        return 0
    if kernel_size is None:
        raise SparseFormatError("padding: 'same' needs the kernel size to be resolved")
    if any(step != 1 for step in _per_dimension(stride, "stride", len(kernel_size))):
        raise SparseFormatError(f"padding: 'same' with stride {stride}; torch allows it at stride 1 only")
    dilations = _per_dimension(dilation, "dilation", len(kernel_size))
    extents = [d * (k - 1) for d, k in zip(dilations, kernel_size, strict=True)]
    if any(extent % 2 for extent in extents):
        raise SparseFormatError(f"padding: 'same' with kernel {tuple(kernel_size)} and dilation {dilation} pads one "
                                "side more than the other, which is not supported")
    return tuple(extent // 2 for extent in extents)


@dataclass(frozen=True)
class ConvGeometry:
    """Everything about a convolution except its weight and input.

    Attributes:
        stride, padding, dilation: ``(along H, along W)`` in elements; a Conv1d uses ``(1, s)``,
            ``(0, p)`` and ``(1, d)``.
        groups: channel groups (``C`` and ``M`` must be divisible by it; the geometry does not know them:
            :meth:`check_channels`).
        spatial_dims: 2 for Conv2d (NCHW input), 1 for Conv1d (NCL input).

    Raises:
        SparseFormatError: on values that are no integers (floats, strings, booleans; numpy and torch integers are
            converted), a non-positive stride/dilation/groups, negative padding, a stride, padding, dilation or
            groups of :data:`~unsparse.sparse.format.SIZE_LIMIT` (2^63) or more (naming it), ``spatial_dims`` other
            than 1 or 2, or a Conv1d geometry other than 1/0/1 along H (its output would gain a height).
    """

    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    groups: int = 1
    spatial_dims: int = 2

    def __post_init__(self) -> None:
        for name in ("stride", "padding", "dilation"):
            object.__setattr__(self, name, _per_dimension(getattr(self, name), name, 2))
        object.__setattr__(self, "groups", _integer(self.groups, "groups"))
        object.__setattr__(self, "spatial_dims", _integer(self.spatial_dims, "spatial_dims"))
        if self.spatial_dims not in (1, 2):
            raise SparseFormatError(f"spatial_dims: expected 1 or 2, got {quote(self.spatial_dims)}")
        if min(self.stride) < 1 or min(self.dilation) < 1 or min(self.padding) < 0 or self.groups < 1:
            raise SparseFormatError(f"geometry: invalid {quote(self)}")
        for name in ("stride", "padding", "dilation", "groups"):
            value = getattr(self, name)
            if max(value if isinstance(value, tuple) else (value,)) >= SIZE_LIMIT:
                raise SparseFormatError(f"{name}: {quote(value)} is 2^63 or more, beyond the int64 sizes and offsets "
                                        "torch indexes with (SIZE_LIMIT, as the file reader bounds every size)")
        if self.spatial_dims == 1 and (self.stride[0], self.padding[0], self.dilation[0]) != (1, 0, 1):
            raise SparseFormatError(f"geometry: a Conv1d (spatial_dims 1) runs over a height of 1, so stride, padding "
                                    f"and dilation along H must be 1, 0 and 1; got {self}")

    @classmethod
    def of(cls, stride: int | tuple[int, ...] = 1, padding: str | int | tuple[int, ...] = 0,
           dilation: int | tuple[int, ...] = 1, groups: int = 1, spatial_dims: int = 2,
           kernel_size: tuple[int, ...] | None = None) -> ConvGeometry:
        """Build from ``torch.nn.functional.conv1d/conv2d``-style arguments (ints, or tuples of one, or of two for
        2-D).

        String padding, as torch takes it, is resolved against ``kernel_size`` (``(R, S)``, or ``(S,)`` for 1-D):
        ``'valid'`` is 0, ``'same'`` is half of each dilated kernel's extent ``dilation * (k - 1)`` where that is
        even (torch allows ``'same'`` at stride 1 only).

        Raises:
            SparseFormatError: for another string, ``'same'`` with a stride other than 1 or without
                ``kernel_size``, or ``'same'`` padding that would be asymmetric (an even dilated kernel).
        """
        if isinstance(padding, str):
            padding = _resolve_padding(padding, kernel_size, stride, dilation)
        if spatial_dims == 1:  # height 1: stride 1, no padding, dilation 1 along H
            return cls((1, *_per_dimension(stride, "stride", 1)), (0, *_per_dimension(padding, "padding", 1)),
                       (1, *_per_dimension(dilation, "dilation", 1)), groups, 1)
        return cls(stride, padding, dilation, groups, 2)

    @classmethod
    def from_module(cls, conv: nn.Conv1d | nn.Conv2d) -> ConvGeometry:
        """Geometry of an ``nn.Conv1d``/``nn.Conv2d`` (or a subclass), string padding resolved as in :meth:`of`.

        Raises:
            TypeError: naming the module's type, for any other module, the transposed convolutions and
                ``nn.Conv3d`` included (they share ``stride``, ``padding`` and ``groups`` attributes, but a transposed
                conv computes another function, and a 3-D one has no geometry here).
            SparseFormatError: for ``'same'`` padding that would be asymmetric (an even dilated kernel), a padding
                mode other than ``'zeros'``, or ``groups`` that does not divide the module's ``in_channels`` and
                ``out_channels`` (:meth:`check_channels`; torch checks them when the conv is built, not when an
                attribute changes later).
        """
        if not isinstance(conv, nn.Conv1d | nn.Conv2d):
            raise TypeError(f"conv: {type(conv).__name__} is not an nn.Conv1d or nn.Conv2d")
        if conv.padding_mode != "zeros":
            raise SparseFormatError(f"padding_mode: {conv.padding_mode!r} is not supported, only 'zeros'")
        dims = 1 if isinstance(conv, nn.Conv1d) else 2
        geometry = cls.of(conv.stride, conv.padding, conv.dilation, conv.groups, dims, conv.kernel_size)
        geometry.check_channels(conv.in_channels, conv.out_channels)
        return geometry

    def check_channels(self, in_channels: int, out_channels: int) -> None:
        """Check that :attr:`groups` divides a convolution's input and output channel counts (``C`` and ``M``), as
        ``F.conv1d``/``F.conv2d`` require.

        Raises:
            SparseFormatError: naming ``groups`` and the channel count it does not divide.
        """
        for name, channels in (("in_channels", in_channels), ("out_channels", out_channels)):
            if channels % self.groups:
                raise SparseFormatError(f"groups: {self.groups} does not divide the {name} ({channels})")

    def to_dict(self) -> dict:
        """JSON-ready form (lists instead of tuples)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data: dict) -> ConvGeometry:
        """Inverse of :meth:`to_dict`.

        Raises:
            SparseFormatError: on missing or extra keys, a value that is not an integer (or a list of two for
                ``stride``, ``padding`` and ``dilation``; strings, floats and booleans are refused, not converted),
                or an invalid geometry.
        """
        expected = {"stride", "padding", "dilation", "groups", "spatial_dims"}
        if not isinstance(data, dict) or set(data) != expected:
            raise SparseFormatError(f"geometry: expected keys {sorted(expected)}, got {quote(data)}")
        def integer(value: object, name: str) -> int:
            # no coercion: int("1") or int(1.7) would read a different number than the file wrote
            if type(value) is not int:
                raise SparseFormatError(f"geometry: {name} must be an integer, got {quote(value)}")
            return value

        def pair(name: str) -> tuple[int, int]:
            value = data[name]
            if not isinstance(value, list) or len(value) != 2:
                raise SparseFormatError(f"geometry: {name} must be a list of two integers, got {quote(value)}")
            return integer(value[0], name), integer(value[1], name)

        return cls(pair("stride"), pair("padding"), pair("dilation"), integer(data["groups"], "groups"),
                   integer(data["spatial_dims"], "spatial_dims"))

    def padded_size(self, height: int, width: int) -> tuple[int, int]:
        """``(Hp, Wp)``: the input size after zero padding, in elements.

        Raises:
            SparseFormatError: naming ``padding``, if either padded size is :data:`~unsparse.sparse.format.SIZE_LIMIT`
                (2^63) or more (no tensor has such a size).
        """
        padded = height + 2 * self.padding[0], width + 2 * self.padding[1]
        if max(padded) >= SIZE_LIMIT:
            raise SparseFormatError(f"padding: {quote(self.padding)} pads an input of {(height, width)} to a size "
                                    "of 2^63 or more, beyond the int64 sizes torch indexes with")
        return padded

    def output_size(self, height: int, width: int, kernel_size: tuple[int, int]) -> tuple[int, int]:
        """``(E, F)``, the ofmap size (Escoin eq. 1 generalised to stride, padding and dilation).

        Raises:
            SparseFormatError: if the kernel has an empty axis (``R`` or ``S`` is 0: no output size; torch refuses
                such a weight), the dilated kernel is larger than the padded input, or a padded size is 2^63 or more
                (:meth:`padded_size`).
        """
        if min(kernel_size) < 1:
            raise SparseFormatError(f"kernel_size: {tuple(kernel_size)} has an empty axis; a convolution needs at "
                                    "least one tap along each")
        hp, wp = self.padded_size(height, width)
        sizes = []
        for padded, k, d, s in zip((hp, wp), kernel_size, self.dilation, self.stride, strict=True):
            span = d * (k - 1) + 1
            if span > padded:
                raise SparseFormatError(f"input: padded size {(hp, wp)} smaller than dilated kernel {kernel_size}")
            sizes.append((padded - span) // s + 1)
        return sizes[0], sizes[1]

    def stretched_offsets(self, col_idx: torch.Tensor, kernel_size: tuple[int, int],
                          padded_hw: tuple[int, int]) -> torch.Tensor:
        """Weight stretching (Escoin §3.1): the offset of each filter entry in one padded NCHW image.

        For ``k = (c * R + r) * S + s`` the offset is ``c * Hp * Wp + r * dil_h * Wp + s * dil_w``, so the
        input element feeding output pixel ``(e, f)`` through that entry is
        ``x_padded_flat[offset + e * stride_h * Wp + f * stride_w]``.

        Args:
            col_idx: ``(M, L)`` int tensor of flat filter indices (validated, in ``[0, C/groups * R * S)``).
            kernel_size: ``(R, S)``.
            padded_hw: ``(Hp, Wp)`` of the padded input.

        Returns:
            ``(M, L)`` int64 tensor on ``col_idx``'s device.

        Raises:
            SparseFormatError: naming ``padded_hw``, if a padded size is 2^63 or more, or an offset would be (an
                image of ``c_max + 1`` padded channels, ``c_max`` the largest channel ``col_idx`` names, beyond the
                int64 offsets torch indexes with; not checked for a ``meta`` tensor, which holds no indices).
        """
        R, S = kernel_size
        hp, wp = padded_hw
        dh, dw = self.dilation
        if max(hp, wp) >= SIZE_LIMIT:
            raise SparseFormatError(f"padded_hw: {tuple(padded_hw)} holds a size of 2^63 or more")
        k = col_idx.long()

        def largest(column: int) -> int:  # the offset of the last tap of ``column``'s channel
            return (column // (R * S) * hp + (R - 1) * dh) * max(wp, 1) + (S - 1) * dw

        # bounded by the index dtype first, on the host: only a geometry that bound leaves open reads the largest
        # column (a reduction, and on CUDA a synchronisation, per call)
        if k.numel() and not k.is_meta and largest(torch.iinfo(col_idx.dtype).max) >= SIZE_LIMIT:
            top = largest(int(k.max()))
            if top >= SIZE_LIMIT:
                raise SparseFormatError(f"padded_hw: {tuple(padded_hw)} with kernel {tuple(kernel_size)} and "
                                        f"dilation {self.dilation} gives offsets up to {top}, 2^63 or more, "
                                        "beyond the int64 offsets torch indexes with")
        c, rs = k // (R * S), k % (R * S)
        r, s = rs // S, rs % S
        # row by row, so that no partial product exceeds the largest offset (hp * wp alone may reach 2^63)
        return (c * hp + r * dh) * wp + s * dw
