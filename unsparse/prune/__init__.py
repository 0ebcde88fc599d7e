"""Pruning: masks as parametrizations, sparsity measures, magnitude baselines and UnSparse-Opt."""

from unsparse.prune.base import Pruner, PruneResult
from unsparse.prune.magnitude import MagnitudePruner
from unsparse.prune.masks import (
    WeightMask,
    attach_masks,
    layer_sparsity,
    masks_of,
    model_weighted_sparsity,
    prunable_layers,
    remove_masks,
    threshold_mask,
    weighted_sparsity,
)

__all__ = ["MagnitudePruner", "PruneResult", "Pruner", "WeightMask", "attach_masks", "layer_sparsity",
           "masks_of", "model_weighted_sparsity", "prunable_layers", "remove_masks", "threshold_mask",
           "weighted_sparsity"]
