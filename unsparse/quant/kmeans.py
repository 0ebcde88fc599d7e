"""``quant=kmeans``: non-linear codebook quantization of each layer's nonzero weights (paper 004 §4, Alg. 3).

Per sparse convolution: the nonzero weights are clustered into ``clusters`` groups with scikit-learn's
``KMeans`` (Alg. 3 line 4), each weight is replaced by its cluster's centroid (lines 5-7, 12), and the
centroids are quantized to ``centroid_bits``-bit signed fixed point (lines 8-10; eq. 19-20 with ``x_sat`` the
largest centroid magnitude). Zeros (pruned weights and UniformCSR padding) are not clustered and stay
exactly zero; weights whose centroid rounds to zero become zeros too and leave the UniformCSR (the layer is
re-packed). The file stores ``ceil(log2 clusters)``-bit indices, packed (two per byte for 16 clusters),
plus the codebook (codec ``codebook``, :mod:`unsparse.quant.codecs`): each distinct stored value once, so at
most ``clusters`` nonzero codes (a file whose layer holds more is refused, :meth:`KMeansQuantizer.check_layer`).
A zero code is no cluster: the quantizers store no zero, but a stored zero before a row's padding (a zero weight
the codec keeps in place) takes one and loads.

The file's quantization description records how the codebooks were made: ``clusters`` and the fit settings
(:data:`FIT_SETTINGS`: the ``KMeans`` arguments ``n_init``, ``max_iter``, ``tol``, ``init``, ``algorithm``,
``random_state``, and ``sklearn_version``, since k-means++ seeding and the iterations may change between
scikit-learn versions), validated on load like the other settings. Every layer's nonzero weights are fitted, none
sampled, so there is no sample size. Files written before the ``KMeans`` arguments were recorded lack all of them,
files written before the version was recorded lack it; both load, and :func:`recorded_fit` reads what they lack as
not recorded (None).
"""

from __future__ import annotations

import functools
import math
import re
from importlib.metadata import version
from typing import Any

import torch

from unsparse.messages import quote
from unsparse.quant.activations import ActivationSpec
from unsparse.quant.finite import check_finite_weights
from unsparse.quant.fixed_point import check_bits, fixed_point_step, from_codes, to_codes
from unsparse.quant.layerwise import LayerwiseQuantizer
from unsparse.settings import SEED_MAX, check_choice, check_integer
from unsparse.sparse.format import SparseFormatError

EMPTY_LAYER_STEP = 1.0
"""Step recorded for a layer without nonzero weights (it has no centroid, so the step is never used)."""
MAX_CLUSTERS = 1 << 16
INITS = ("k-means++", "random")
"""``init`` methods of ``sklearn.cluster.KMeans`` that take no data of their own."""
TOL = 1e-4
"""``tol`` passed to ``sklearn.cluster.KMeans`` (its default, made explicit so that a change of scikit-learn's default
cannot change the codebooks unseen): convergence tolerance, relative to the weights' variance."""
ALGORITHM = "lloyd"
"""``algorithm`` passed to ``sklearn.cluster.KMeans`` (its default, made explicit as :data:`TOL` is)."""
KMEANS_ARGUMENTS = ("n_init", "max_iter", "tol", "init", "algorithm", "random_state")
"""The ``sklearn.cluster.KMeans`` arguments besides ``n_clusters`` (``clusters``) recorded in the description's
``weights``; a description written before they were recorded holds none of them."""
FIT_SETTINGS = (*KMEANS_ARGUMENTS, "sklearn_version")
"""Everything recorded of how the codebooks were fitted besides ``clusters``: :data:`KMEANS_ARGUMENTS` and the
scikit-learn version that ran them (``sklearn_version``, recorded since after the arguments: a description may hold
the arguments without it)."""
VERSION = re.compile(r"[0-9][0-9A-Za-z.+!_-]{0,63}")
"""A recorded ``sklearn_version``: a version string (``1.5.2``, ``1.6.dev0``, ``1.5.2+local``), at most 64
characters."""


@functools.cache
def installed_sklearn_version() -> str:
    """The version of the installed scikit-learn (``importlib.metadata``, without importing it), read once per
    process: each quantizer built (one per layer where a file is loaded) and each clustered layer asks for it.

    Raises:
        importlib.metadata.PackageNotFoundError: scikit-learn is not installed.
    """
    return version("scikit-learn")


def check_sklearn_version(value: Any) -> str:
    """``value`` if it is a version string (:data:`VERSION`).

    Raises:
        ValueError: ``sklearn_version: ...`` quoting ``value`` (cut to 200 characters) otherwise.
    """
    if not isinstance(value, str) or not VERSION.fullmatch(value):
        raise ValueError(f"sklearn_version: expected a version string such as '1.5.2' (at most 64 characters), got "
                         f"{quote(value)}")
    return value


class KMeansQuantizer(LayerwiseQuantizer):
    """Codebook quantization of each sparse convolution's nonzero weights.

    A layer with at most ``clusters`` distinct nonzero weights (e.g. a constant layer) uses them as its
    centroids exactly, without running k-means.

    Args:
        clusters: centroids per layer in ``[2, 65536]`` (16: 4-bit indices, the paper's setting).
        centroid_bits: bits of each centroid in ``[2, 16]`` (paper: 8 or 16).
        n_init: k-means runs per layer, the best kept (an integer >= 1).
        max_iter: iterations per run (an integer >= 1).
        init: ``"k-means++"`` or ``"random"``.
        random_state: seed, an integer in ``[0, 2^32 - 1]`` (:data:`~unsparse.settings.SEED_MAX`, also the largest
            seed scikit-learn takes; fixed: repeatable). These four, :data:`TOL` and
            :data:`ALGORITHM` (the :data:`KMEANS_ARGUMENTS`) are passed to ``sklearn.cluster.KMeans`` and recorded in
            the description, with the installed scikit-learn's version (``sklearn_version``).
        activations: default float16 (the paper's 4b/16b row reads as 4-bit weights, 16-bit activations).
        progress: tqdm bars during calibration.

    Raises:
        ValueError: any argument out of range or of the wrong type, naming it (checked here, not when
            scikit-learn first runs).
    """

    scheme = "kmeans"
    default_activations = ActivationSpec(format="fp16")
    optional_settings = (frozenset(KMEANS_ARGUMENTS), frozenset({"sklearn_version"}))
    tol = TOL
    algorithm = ALGORITHM

    def __init__(self, clusters: int = 16, centroid_bits: int = 8, n_init: int = 4, max_iter: int = 300,
                 init: str = "k-means++", random_state: int = 0, activations: ActivationSpec | None = None,
                 progress: bool = True) -> None:
        super().__init__(activations, progress)
        self.clusters = check_integer(clusters, "clusters", 2, MAX_CLUSTERS)
        self.centroid_bits = check_bits(centroid_bits, "centroid_bits")
        self.index_bits = math.ceil(math.log2(clusters))
        self.n_init, self.max_iter = check_integer(n_init, "n_init"), check_integer(max_iter, "max_iter")
        self.init = check_choice(init, INITS, "init")
        self.random_state = check_integer(random_state, "random_state", 0, SEED_MAX)
        self.sklearn_version = installed_sklearn_version()

    def cluster(self, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Centroids ``(k,)`` float64 and each weight's centroid index ``(n,)`` int64 for ``weights`` ``(n,)``.

        ``k <= clusters``; with at most ``clusters`` distinct weights the centroids are those weights (Alg. 3 line 4).

        Raises:
            ValueError: NaN or infinite weights, counted (:func:`~unsparse.quant.finite.check_finite_weights`), or
                k-means to run under another scikit-learn than the :attr:`sklearn_version` this quantizer records
                (one :meth:`from_settings` made from a file of another version): its description would name a
                version that did not make the codebooks.
        """
        check_finite_weights(weights)
        distinct, inverse = torch.unique(weights, return_inverse=True)
        if distinct.numel() <= self.clusters:
            return distinct, inverse
        if self.sklearn_version != installed_sklearn_version():
            raise ValueError(f"sklearn_version: this quantizer records codebooks of scikit-learn {self.sklearn_version}"
                             f", but {installed_sklearn_version()} is installed; a new KMeansQuantizer records it")
        from sklearn.cluster import KMeans

        arguments = {key: getattr(self, key) for key in KMEANS_ARGUMENTS}
        kmeans = KMeans(n_clusters=self.clusters, **arguments).fit(weights.reshape(-1, 1).numpy())
        return torch.from_numpy(kmeans.cluster_centers_[:, 0]), torch.from_numpy(kmeans.labels_).to(torch.int64)

    def quantize_values(self, values: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """Every nonzero weight replaced by its quantized centroid, zeros unchanged; float32 whatever the real dtype
        of ``values`` (as the other schemes return).

        A centroid smaller than half a centroid step rounds to 0: its weights become zeros.

        Args:
            values: weights of any shape and float dtype (a layer's UniformCSR values ``(M, L)``).

        Returns:
            ``(quantized float32 of the shape of values, {"step": Δ})``, ``Δ`` the centroids' float32 step in the
            weights' unit (Alg. 3 lines 8-10).

        Raises:
            ValueError: NaN or infinite weights, counted (:func:`~unsparse.quant.finite.check_finite_weights`).
        """
        check_finite_weights(values)
        nonzero = values != 0
        quantized = torch.zeros_like(values, dtype=torch.float32)
        if not bool(nonzero.any()):
            return quantized, {"step": EMPTY_LAYER_STEP}
        centroids, labels = self.cluster(values[nonzero].to(torch.float64))
        step = fixed_point_step(float(centroids.abs().max()), self.centroid_bits)
        quantized[nonzero] = from_codes(to_codes(centroids, step, self.centroid_bits)[labels], step)
        return quantized, {"step": step}

    def values_codec(self) -> dict[str, Any]:
        return {"name": "codebook", "index_bits": self.index_bits, "centroid_bits": self.centroid_bits}

    def check_layer(self, name: str, values: torch.Tensor, codec: dict[str, Any]) -> None:
        """At most ``clusters`` distinct nonzero values, the nonzero centroids of the layer's codebook (which holds
        each distinct stored value once; ``index_bits`` alone admits up to ``2^index_bits``).

        Raises:
            SparseFormatError: naming ``<name>.values::centroids`` and ``clusters``.
        """
        centroids = torch.unique(values[values != 0]).numel()
        if centroids > self.clusters:
            raise SparseFormatError(f"{name}.values::centroids: {centroids} nonzero centroids, "
                                    f"quantization.weights.clusters allows at most {self.clusters}")

    def fit_settings(self) -> dict[str, Any]:
        """The :data:`FIT_SETTINGS` (JSON-ready): the ``sklearn.cluster.KMeans`` arguments besides ``n_clusters`` and
        the scikit-learn version."""
        return {key: getattr(self, key) for key in FIT_SETTINGS}

    def settings(self) -> dict[str, Any]:
        return {"clusters": self.clusters, "index_bits": self.index_bits, "centroid_bits": self.centroid_bits,
                **self.fit_settings()}

    @classmethod
    def from_settings(cls, weights: dict[str, Any]) -> KMeansQuantizer:
        """The quantizer ``weights`` describes; the :data:`KMEANS_ARGUMENTS` it lacks take their defaults (a
        description that lacks only some of them is refused by :meth:`described`, as is one whose ``tol`` or
        ``algorithm`` is not :data:`TOL` or :data:`ALGORITHM`: this code made no such codebook), and its
        ``sklearn_version`` is the recorded one where there is one, else the installed one.

        Raises:
            KeyError: ``clusters`` or ``centroid_bits`` missing.
            ValueError: a setting out of range or of the wrong type, naming it (``sklearn_version`` not a version
                string: :func:`check_sklearn_version`).
        """
        fit = {key: weights[key] for key in ("n_init", "max_iter", "init", "random_state") if key in weights}
        quantizer = cls(clusters=weights["clusters"], centroid_bits=weights["centroid_bits"], progress=False, **fit)
        if "sklearn_version" in weights:
            quantizer.sklearn_version = check_sklearn_version(weights["sklearn_version"])
        return quantizer


def recorded_fit(description: dict[str, Any]) -> dict[str, Any]:
    """How a k-means description's codebooks were made (paper 004 §4, Alg. 3 line 4): ``clusters`` and each of
    :data:`FIT_SETTINGS` as recorded, or None for each one the description does not record (a file written before
    the ``KMeans`` arguments, or before ``sklearn_version``, was recorded).

    Args:
        description: a model's quantization description (``unsparse_quantization``, the file's ``quantization``).

    Returns:
        ``{"clusters": int, "n_init": int | None, "max_iter": int | None, "tol": float | None, "init": str | None,
        "algorithm": str | None, "random_state": int | None, "sklearn_version": str | None}``.

    Raises:
        SparseFormatError: the description is not a valid k-means one (naming the field, as on load).
    """
    if not isinstance(description, dict):
        raise SparseFormatError(f"quantization: expected an object, got {type(description).__name__}")
    if description.get("scheme") != KMeansQuantizer.scheme:
        raise SparseFormatError(f"quantization.scheme: expected 'kmeans', got {quote(description.get('scheme'))}")
    quantizer = KMeansQuantizer.described(description)
    recorded = set(description["weights"])
    return {"clusters": quantizer.clusters,
            **{key: value if key in recorded else None for key, value in quantizer.fit_settings().items()}}
