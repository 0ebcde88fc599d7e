"""Plans: which backend (and tuning parameters) runs each layer, keyed by GPU, shapes and dtype.

A plan is the comparator's output (DESIGN.md, Runtime and comparator) and is reused by later runs: a
layer whose key is already in the plan is not measured again. The ``"auto"`` backend looks layers up in
the active plan (:func:`use_plan`).
"""

from __future__ import annotations

import json
import logging
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from unsparse.atomic import atomic_write_text
from unsparse.runtime.backends.base import ConvBackend, get_backend, register_backend
from unsparse.runtime.layout import layout_of
from unsparse.sparse.format import UniformCSR
from unsparse.sparse.geometry import ConvGeometry

log = logging.getLogger(__name__)

PLAN_VERSION = 1


def device_name(device: torch.device | str) -> str:
    """``torch.cuda.get_device_name`` for CUDA devices, ``"cpu"`` otherwise."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def precision_tag(dtype: torch.dtype, device: torch.device | str) -> str:
    """dtype name, with ``+tf32`` for float32 on CUDA while cuDNN may use TF32 (a different problem)."""
    name = str(dtype).removeprefix("torch.")
    if dtype == torch.float32 and torch.device(device).type == "cuda" and torch.backends.cudnn.allow_tf32:
        return name + "+tf32"
    return name


def layer_key(x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry, device: str | None = None) -> str:
    """Plan key of one layer on one input: GPU name, precision, input shape (batch included), weight
    shape, row length L, stride, padding, dilation, groups, and ``fmt=nhwc`` for a channels-last input
    (:func:`~unsparse.runtime.layout.layout_of`; NCHW keys carry no layout part, as before layouts were planned).
    A string so that it is a JSON object key."""
    device = device if device is not None else device_name(x.device)
    parts = [device, precision_tag(x.dtype, x.device), "x=" + "x".join(map(str, x.shape)),
             "w=" + "x".join(map(str, csr.weight_shape)), f"L={csr.row_length}",
             "s={}x{}".format(*geometry.stride), "p={}x{}".format(*geometry.padding),
             "d={}x{}".format(*geometry.dilation), f"g={geometry.groups}", f"dims={geometry.spatial_dims}"]
    layout = layout_of(x)
    return "|".join(parts if layout == "nchw" else [*parts, f"fmt={layout}"])


def key_layout(key: str) -> str:
    """The input layout a :func:`layer_key` was made for: ``"nhwc"`` or ``"nchw"``."""
    return key.rpartition("|fmt=")[2] if "|fmt=" in key else "nchw"


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
        """JSON-ready form: ``{"version": 1, "entries": {key: {backend, params, median_ms, runner_up}}}``."""
        return {"version": PLAN_VERSION, "entries": {k: asdict(v) for k, v in self.entries.items()}}

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """Inverse of :meth:`to_dict`.

        Raises:
            PlanError: wrong version, missing fields, wrong types or unknown backend names.
        """
        if not isinstance(data, dict) or data.get("version") != PLAN_VERSION:
            raise PlanError(f"version: expected {PLAN_VERSION}")
        entries = data.get("entries")
        if not isinstance(entries, dict):
            raise PlanError("entries: expected an object")
        plan = cls()
        for key, raw in entries.items():
            if not isinstance(raw, dict) or set(raw) != {"backend", "params", "median_ms", "runner_up"}:
                raise PlanError(f"entries[{key!r}]: expected backend, params, median_ms, runner_up")
            if not isinstance(raw["backend"], str) or not isinstance(raw["params"], dict):
                raise PlanError(f"entries[{key!r}]: backend must be a string and params an object")
            try:
                get_backend(raw["backend"])
            except KeyError as error:
                raise PlanError(f"entries[{key!r}].backend: {error}") from error
            plan.entries[key] = PlanEntry(raw["backend"], raw["params"], float(raw["median_ms"]),
                                          raw["runner_up"])
        return plan

    def save(self, path: str | Path) -> None:
        """Write JSON atomically (:func:`~unsparse.atomic.atomic_write_text`: temporary file in the same folder,
        flushed to disk, then renamed; removed if anything fails)."""
        atomic_write_text(path, json.dumps(self.to_dict(), indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`save`.

        Raises:
            PlanError: invalid JSON or content. OSError: unreadable file.
        """
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise PlanError(f"{path}: not JSON ({error})") from error
        return cls.from_dict(data)


_ACTIVE = Plan()


def use_plan(plan: Plan) -> None:
    """Make ``plan``'s entries visible to the ``"auto"`` backend (merged into the active plan)."""
    _ACTIVE.entries.update(plan.entries)
    get_backend("auto").forget()


def active_plan() -> Plan:
    """The plan the ``"auto"`` backend consults."""
    return _ACTIVE


@register_backend
class AutoBackend(ConvBackend):
    """Runs the planned backend of each layer; layers missing from the active plan run dense (logged)."""

    name = "auto"
    device_types = frozenset({"cpu", "cuda"})

    def __init__(self) -> None:
        self._logged: set[str] = set()
        self._resolved: weakref.WeakKeyDictionary[UniformCSR, dict[tuple, tuple[str, dict[str, Any]]]] = (
            weakref.WeakKeyDictionary())

    def forget(self) -> None:
        """Drop the per-layer resolutions (called when the active plan changes)."""
        self._resolved = weakref.WeakKeyDictionary()

    def resolve(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> tuple[str, dict[str, Any]]:
        """``(backend, params)`` for this layer and input: the plan's entry, else the dense backend.

        Resolutions are cached per weight and (input shape, layout, dtype, device, TF32 flag, geometry), so a
        planned model pays the plan-key lookup once per layer, not on every forward pass.
        """
        signature = (tuple(x.shape), layout_of(x), x.dtype, x.device, torch.backends.cudnn.allow_tf32, geometry)
        per_csr = self._resolved.setdefault(csr, {})
        if signature not in per_csr:
            per_csr[signature] = self._lookup(x, csr, geometry)
        return per_csr[signature]

    def _lookup(self, x: torch.Tensor, csr: UniformCSR, geometry: ConvGeometry) -> tuple[str, dict[str, Any]]:
        from unsparse.sparse.functional import dense_fallback_backend

        key = layer_key(x, csr, geometry)
        entry = _ACTIVE.get(key)
        if entry is None:
            if key not in self._logged:
                self._logged.add(key)
                log.warning("auto: no plan entry for %s; running dense", key)
            return dense_fallback_backend(x.device), {}
        return entry.backend, entry.params

    def conv(self, x: torch.Tensor, csr: UniformCSR, bias: torch.Tensor | None, geometry: ConvGeometry,
             **params: Any) -> torch.Tensor:
        backend, planned = self.resolve(x, csr, geometry)
        return get_backend(backend).conv(x, csr, bias, geometry, **planned)  # run() converts the output once
