"""What screening ``generated``'s dear settings would have cost, replayed on committed per-layer results, and how
close its estimates came to the settings' full timings.

:data:`~unsparse.runtime.comparator.SCREEN_RATIO` decides whether a layer's kernels of several programs (``programs``
above 1, minutes of NVRTC each) are built: only where the best one-program setting comes within the ratio of the
backends timed before ``generated`` (cuDNN, then ``direct``). This replays that rule on benchmark records that timed
both kinds, so a ratio is chosen from measurements, not guessed: how many layers would have skipped the dear kernels,
and how many of their wins would have been lost, with how close each lost win was to the rival.

The comparator also estimates ``generated``'s one-program settings before building them
(:meth:`~unsparse.runtime.backends.base.ConvBackend.estimate_ms`) and records each estimate; :func:`estimate_errors`
sets those beside the full medians of the settings it built.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

RIVALS = ("cudnn", "direct")
"""Backends the comparator times before ``generated`` in the benchmark's order (``plan_backends``,
``layer_backends``)."""


@dataclass(frozen=True)
class ScreenedLayer:
    """One per-layer comparison that timed ``generated``'s settings of one and of several programs.

    Attributes:
        source, layer, precision, batch: where it comes from. rival_ms: the fastest correct median of :data:`RIVALS`.
        single_ms, shared_ms: the fastest correct medians of ``generated``'s settings of one / several programs.
    """

    source: str
    layer: str
    precision: str
    batch: int
    rival_ms: float
    single_ms: float
    shared_ms: float

    @property
    def shared_wins(self) -> bool:
        """Whether a kernel of several programs was the fastest setting of all."""
        return self.shared_ms < min(self.single_ms, self.rival_ms)


def screened_layers(results: Iterable[tuple[str, dict[str, Any]]]) -> list[ScreenedLayer]:
    """The comparisons of ``results`` (``(name, bench.json)`` pairs) whose ``generated`` measurements hold correct
    timings with ``programs`` 1 and above 1, and a correct rival timing."""
    layers = []
    for source, result in results:
        for record in result.get("layers") or []:
            measurements = (record.get("comparison") or {}).get("measurements") or []
            timed = [m for m in measurements if m["status"] == "ok" and m.get("median_ms")]
            generated = [m for m in timed if m["backend"] == "generated"]
            single = [m["median_ms"] for m in generated if m["params"].get("programs", 1) == 1]
            shared = [m["median_ms"] for m in generated if m["params"].get("programs", 1) > 1]
            rivals = [m["median_ms"] for m in timed if m["backend"] in RIVALS]
            if single and shared and rivals:
                layers.append(ScreenedLayer(source, record["layer"], record["precision"], record["batch"],
                                            min(rivals), min(single), min(shared)))
    return layers


def replay(layers: Sequence[ScreenedLayer], ratio: float) -> dict[str, Any]:
    """The screening rule at ``ratio`` on ``layers``: ``layers``, ``shared_wins`` (kernels of several programs
    fastest), ``skipped`` (layers whose best one-program setting is beyond ``ratio`` x the rival, so their dear
    kernels would not be built) and ``lost`` (the skipped wins, each with its shared / rival time ratio)."""
    skipped = [layer for layer in layers if layer.single_ms > ratio * layer.rival_ms]
    return {"ratio": ratio, "layers": len(layers), "shared_wins": sum(layer.shared_wins for layer in layers),
            "skipped": len(skipped),
            "lost": [{"source": layer.source, "layer": layer.layer, "precision": layer.precision,
                      "batch": layer.batch, "shared_over_rival": layer.shared_ms / layer.rival_ms}
                     for layer in skipped if layer.shared_wins]}


def estimate_errors(results: Iterable[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Every correct, fully timed measurement of ``results`` (``(name, bench.json)`` pairs, per-layer comparisons)
    that carries an estimate: ``source``, ``layer``, ``precision``, ``batch``, ``backend``, ``params``,
    ``estimate_ms``, ``median_ms`` and ``ratio`` (median over estimate: above 1 the estimate was optimistic)."""
    errors = []
    for source, result in results:
        for record in result.get("layers") or []:
            for m in (record.get("comparison") or {}).get("measurements") or []:
                if m["status"] == "ok" and m.get("timing") and m.get("estimate_ms"):
                    median = m["timing"]["median_ms"]
                    errors.append({"source": source, "layer": record["layer"], "precision": record["precision"],
                                   "batch": record["batch"], "backend": m["backend"], "params": m["params"],
                                   "estimate_ms": m["estimate_ms"], "median_ms": median,
                                   "ratio": median / m["estimate_ms"]})
    return errors
