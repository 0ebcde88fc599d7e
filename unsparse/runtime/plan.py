"""Plans: which backend (and tuning parameters) runs each layer, keyed by GPU, shapes and dtype.

A plan is the comparator's output (DESIGN.md, Runtime and comparator) and is reused by later runs: a
layer whose key is already in the plan is not measured again. The ``"auto"`` backend looks layers up in
the active plan (:func:`use_plan`).
"""

from __future__ import annotations

import json
import logging
import math
import weakref
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from unsparse.atomic import atomic_write_text
from unsparse.runtime.backends.base import EPILOGUE_PARAMETER, ConvBackend, get_backend, register_backend
from unsparse.runtime.layout import layout_of
from unsparse.runtime.precision import tf32_flags
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry
from unsparse.strict_json import loads_strict

log = logging.getLogger(__name__)

PLAN_VERSION = 1


def device_name(device: torch.device | str) -> str:
    """``torch.cuda.get_device_name`` for CUDA devices, ``"cpu"`` otherwise."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def precision_tag(dtype: torch.dtype, device: torch.device | str) -> str:
    """dtype name, with ``+tf32`` for float32 on CUDA while cuDNN may use TF32 (a different problem), and the
    cuBLAS flag where it differs from cuDNN's (``+matmul_tf32`` / ``+matmul_fp32``: the lowering backends'
    products), so an entry chosen under one precision is not run under another."""
    name = str(dtype).removeprefix("torch.")
    if dtype != torch.float32 or torch.device(device).type != "cuda":
        return name
    cudnn, matmul = tf32_flags()
    name += "+tf32" if cudnn else ""
    return name if matmul == cudnn else name + ("+matmul_tf32" if matmul else "+matmul_fp32")


EPILOGUE_PART = "|epilogue="
"""Where a :func:`layer_key` names what the layer is fused with (:func:`epilogue_name`)."""


def epilogue_name(relu: bool, max_pool: bool, residual: bool = False) -> str:
    """What a fused layer applies after its convolution, in order, as its plan key names it: ``"relu"``,
    ``"max_pool"``, ``"relu+max_pool"``, ``"residual+relu"`` (a residual block's add, then the ReLU), or ``""`` for
    none."""
    return "+".join(name for name, fused in (("residual", residual), ("relu", relu), ("max_pool", max_pool)) if fused)


def layer_key(x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry, device: str | None = None,
              relu: bool = False, max_pool: bool = False, residual: bool = False) -> str:
    """Plan key of one layer on one input: GPU name, precision, input shape (batch included), weight
    shape, row length L, stride, padding, dilation, groups, ``wdtype=`` where the weight's dtype differs from the
    input's (the direct kernels need them equal; NCHW-era keys with equal dtypes are unchanged), ``epilogue=`` for a
    layer fused with the ReLU or the 2x2 max pool after it, or with a residual add and the ReLU after that
    (``relu``, ``max_pool``, ``residual``:
    :func:`~unsparse.runtime.modules.sparsify`'s fusions; :func:`epilogue_name`), whose comparison timed each
    backend with what it is fused with, and ``fmt=nhwc`` for a channels-last input
    (:func:`~unsparse.runtime.layout.layout_of`; NCHW keys carry no layout part, as before layouts were planned).
    An unfused layer's key is as before fusions were planned. A string so that it is a JSON object key."""
    device = device if device is not None else device_name(x.device)
    parts = [device, precision_tag(x.dtype, x.device), "x=" + "x".join(map(str, x.shape)),
             "w=" + "x".join(map(str, csr.weight_shape)), f"L={csr.row_length}",
             "s={}x{}".format(*geometry.stride), "p={}x{}".format(*geometry.padding),
             "d={}x{}".format(*geometry.dilation), f"g={geometry.groups}", f"dims={geometry.spatial_dims}"]
    if csr.values.dtype != x.dtype:
        parts.append("wdtype=" + str(csr.values.dtype).removeprefix("torch."))
    if relu or max_pool or residual:
        parts.append(EPILOGUE_PART.removeprefix("|") + epilogue_name(relu, max_pool, residual))
    layout = layout_of(x)
    return "|".join(parts if layout == "nchw" else [*parts, f"fmt={layout}"])


def key_layout(key: str) -> str:
    """The input layout a :func:`layer_key` was made for: ``"nhwc"`` or ``"nchw"``."""
    return key.rpartition("|fmt=")[2] if "|fmt=" in key else "nchw"


def without_epilogue(key: str) -> str:
    """The :func:`layer_key` of the same layer and input unfused: ``key`` without its ``epilogue=`` part."""
    head, found, tail = key.partition(EPILOGUE_PART)
    return head + (tail[tail.index("|"):] if found and "|" in tail else "")


@dataclass
class PlanEntry:
    """The chosen backend of one layer key.

    Attributes:
        backend: registered backend name. params: one entry of its tuning space.
        median_ms: its measured median time (ms). runner_up: next fastest backend name, if any.
    """

    backend: str
    params: dict[str, Any] = field(default_factory=dict)
    median_ms: float = float("nan")
    runner_up: str | None = None

    def unfused(self) -> PlanEntry:
        """The same choice for the layer unfused (its key :func:`without_epilogue`): ``params`` without the way to run
        a fused ReLU (:data:`~unsparse.runtime.backends.base.EPILOGUE_PARAMETER`), which a layer has only fused; the
        entry itself where it has none."""
        if EPILOGUE_PARAMETER not in self.params:
            return self
        return replace(self, params={k: v for k, v in self.params.items() if k != EPILOGUE_PARAMETER})


class PlanError(ValueError):
    """A plan file or dict is malformed; the message names the field."""


@dataclass
class Plan:
    """Layer key -> :class:`PlanEntry`."""

    entries: dict[str, PlanEntry] = field(default_factory=dict)

    def get(self, key: str) -> PlanEntry | None:
        """The entry for ``key`` or None."""
        return self.entries.get(key)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: ``{"version": 1, "entries": {key: {backend, params, median_ms, runner_up}}}``; a median
        that was not measured (NaN) is written as null, so the file is strict JSON."""
        return {"version": PLAN_VERSION,
                "entries": {k: {**asdict(v), "median_ms": v.median_ms if math.isfinite(v.median_ms) else None}
                            for k, v in self.entries.items()}}

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """Inverse of :meth:`to_dict`. A plan file is untrusted input, like a sparse model file: every field is
        checked here, and each entry's ``params`` again when a layer first uses it (:class:`AutoBackend`: it must
        be a setting the backend offers for that layer).

        Raises:
            PlanError: naming the field: a version other than the integer 1, missing or extra fields, a backend
                that is not registered (or ``"auto"``, which would dispatch to itself), params that are not an
                object of string keys and scalar values (string, integer, boolean), a median that is not a
                non-negative number or null, a runner-up that is not a registered backend or null.
        """
        if not isinstance(data, dict) or type(data.get("version")) is not int or data["version"] != PLAN_VERSION:
            raise PlanError(f"version: expected the integer {PLAN_VERSION}")
        if set(data) != {"version", "entries"}:
            raise PlanError(f"plan: expected the fields version and entries, got {sorted(data)}")
        entries = data["entries"]
        if not isinstance(entries, dict):
            raise PlanError("entries: expected an object")
        plan, known = cls(), _planned_backends()
        for key, raw in entries.items():
            field_name = f"entries[{key!r}]"
            if not isinstance(raw, dict) or set(raw) != {"backend", "params", "median_ms", "runner_up"}:
                raise PlanError(f"{field_name}: expected backend, params, median_ms, runner_up")
            if raw["backend"] not in known:
                raise PlanError(f"{field_name}.backend: {raw['backend']!r} is not a backend a plan may name; known: "
                                f"{sorted(known)}")
            params = raw["params"]
            if not isinstance(params, dict) or not all(isinstance(value, str | int) for value in params.values()):
                raise PlanError(f"{field_name}.params: expected an object of strings, integers and booleans, got "
                                f"{params!r}")
            median = raw["median_ms"]
            if median is not None and (type(median) not in (int, float) or not 0 <= median < 1e300):  # int: no overflow
                raise PlanError(f"{field_name}.median_ms: expected a non-negative number or null, got {median!r}")
            if raw["runner_up"] is not None and raw["runner_up"] not in known:
                raise PlanError(f"{field_name}.runner_up: {raw['runner_up']!r} is not a registered backend")
            plan.entries[key] = PlanEntry(raw["backend"], dict(params), math.nan if median is None else float(median),
                                          raw["runner_up"])
        return plan

    def save(self, path: str | Path) -> None:
        """Write JSON atomically (:func:`~unsparse.atomic.atomic_write_text`: temporary file in the same folder,
        flushed to disk, then renamed; removed if anything fails)."""
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save` (untrusted: see :meth:`from_dict`).

        Raises:
            PlanError: not UTF-8, not strict JSON (NaN and Infinity literals, duplicate keys, nesting beyond the
                parser), or invalid content (:meth:`from_dict`); the message names the file. OSError: unreadable
                file.
        """
        raw = Path(path).read_bytes()
        try:
            data = loads_strict(raw.decode("utf-8"))
            return cls.from_dict(data)
        except PlanError as error:
            raise PlanError(f"{path}: {error}") from error
        except (ValueError, RecursionError) as error:  # ValueError: JSON syntax, UTF-8, digit limit
            raise PlanError(f"{path}: not a plan file ({type(error).__name__}: {error})") from error


def _planned_backends() -> set[str]:
    """Backends a plan entry may name: every registered one but ``"auto"`` (the dispatcher itself)."""
    from unsparse.runtime.backends import backend_names

    return set(backend_names()) - {"auto"}


_ACTIVE = Plan()


_GENERATION = 0


def use_plan(plan: Plan) -> None:
    """Make ``plan``'s entries visible to the ``"auto"`` backend (merged into the active plan); moves
    :func:`plan_generation`."""
    global _GENERATION
    _ACTIVE.entries.update(plan.entries)
    _GENERATION += 1
    get_backend("auto").forget()


def plan_generation() -> int:
    """How many times :func:`use_plan` changed the active plan: what was resolved through the ``"auto"`` backend
    under another generation may name another entry."""
    return _GENERATION


def active_plan() -> Plan:
    """The plan the ``"auto"`` backend consults."""
    return _ACTIVE


@register_backend
class AutoBackend(ConvBackend):
    """Runs the planned backend of each layer; layers missing from the active plan run dense (logged).

    An entry is checked when a layer first resolves to it: its backend must support the layer on this input
    (else the layer runs dense, logged, as :func:`~unsparse.sparse.functional.sparse_conv` does for a backend named
    directly), and its ``params`` must be empty (the backend's defaults, as the dense fallback entries are) or one
    of the settings the backend offers for the layer (:meth:`~unsparse.runtime.backends.base.ConvBackend.settings`,
    the settings the comparator times), so a tampered or stale plan cannot pass other values into a kernel launch.
    """

    name = "auto"
    device_types = frozenset({"cpu", "cuda"})

    def unsupported_reason(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> str | None:
        """The device only: the planned backend's own check decides the rest when the layer resolves, so a grouped
        layer keeps its planned dense setting."""
        return None if x.device.type in self.device_types else super().unsupported_reason(x, csr, geometry)

    def __init__(self) -> None:
        self._logged: set[str] = set()
        self._resolved: weakref.WeakKeyDictionary[UniformCSR, dict[tuple, tuple[str, dict[str, Any]]]] = (
            weakref.WeakKeyDictionary())

    def forget(self) -> None:
        """Drop the per-layer resolutions (called when the active plan changes)."""
        self._resolved = weakref.WeakKeyDictionary()

    def resolve(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry, relu: bool = False,
                max_pool: bool = False, residual: bool = False) -> tuple[str, dict[str, Any]]:
        """``(backend, params)`` for this layer and input, fused with its ReLU, its max pool and a residual add as
        ``relu``, ``max_pool`` and ``residual`` say (the key's ``epilogue=`` part, :func:`layer_key`): the plan's
        entry, else the dense backend.

        Resolutions are cached per weight and (input shape, layout, dtype, device, TF32 flags, geometry, epilogue),
        so a planned model pays the plan-key lookup and the entry's checks once per layer, not on every forward pass.

        Raises:
            PlanError: the entry's ``params`` are not a setting its backend offers for this layer.
        """
        signature = (tuple(x.shape), layout_of(x), x.dtype, x.device, *tf32_flags(), geometry, relu, max_pool,
                     residual)  # precision_tag's flags
        per_csr = self._resolved.setdefault(csr, {})
        if signature not in per_csr:
            per_csr[signature] = self._lookup(x, csr, geometry, relu, max_pool, residual)
        return per_csr[signature]

    def _lookup(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry, relu: bool, max_pool: bool,
                residual: bool) -> tuple[str, dict[str, Any]]:
        from unsparse.sparse.functional import dense_fallback_backend

        key = layer_key(x, csr, geometry, relu=relu, max_pool=max_pool, residual=residual)
        entry = _ACTIVE.get(key)
        if entry is None:
            if key not in self._logged:
                self._logged.add(key)
                log.warning("auto: no plan entry for %s; running dense", key)
            return dense_fallback_backend(x.device), {}
        backend = get_backend(entry.backend)
        reason = backend.unsupported_reason(x, csr, geometry)
        if reason is not None:
            log.warning("auto: the plan's %s does not run %s (%s); running dense", entry.backend, key, reason)
            return dense_fallback_backend(x.device), {}
        if entry.params and entry.params not in backend.settings(x, csr, geometry, relu):  # {}: the defaults
            raise PlanError(f"entries[{key!r}].params: {entry.params} is not a setting {entry.backend} offers for "
                            "this layer (a plan of another version, or edited)")
        return entry.backend, entry.params

    def conv(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
             **params: Any) -> torch.Tensor:
        backend, planned = self.resolve(x, csr, geometry)
        return get_backend(backend).conv(x, csr, bias, geometry, **planned)  # run() converts the output once

    def prepare(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
                relu: bool = False, max_pool: bool = False, residual: torch.Tensor | None = None,
                **params: Any) -> Callable[..., torch.Tensor]:
        """The planned backend's :meth:`~unsparse.runtime.backends.base.ConvBackend.prepare` (and so its
        :meth:`~unsparse.runtime.backends.base.ConvBackend.run`), so that a layer fused with its ReLU or its max pool
        gets them (and a residual add) in the epilogue of a backend that fuses them; the entry is the fused layer's
        (:meth:`resolve`). A prepared call holds the entry resolved when it was made: :func:`use_plan` moves
        :func:`plan_generation`, by which ``SparseConv`` knows to prepare again."""
        backend, planned = self.resolve(x, csr, geometry, relu, max_pool, residual is not None)
        return get_backend(backend).prepare(x, csr, bias, geometry, relu, max_pool, residual, **planned)
