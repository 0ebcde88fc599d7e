"""Evolutionary pruning with gradient statistics and rewinding (UnSparse-Opt Algorithm 2, paper 004 §3.1).

The paper's text lacks its equations; this follows the reading in ``DESIGN.md``. One iteration ``t``:

1. choose a subset ``C_t`` of layers to prune further (line 10), drawn without replacement with probability
   proportional to the weights a layer may still lose, ``size_l * (max_layer_sparsity - s_l)``;
2. train ``batches_per_iteration`` batches (or one epoch) with the masks applied (eq. 9: the
   ``WeightMask`` parametrization multiplies every forward's weight by its mask, so pruned weights are 0 in
   every step) and accumulate ``|grad|`` of the dense weights (line 11);
3. ``G_l`` = mean ``|grad|`` per weight over those batches (eq. 10, line 12);
4. validation score (top-1 %, or ``-MSE``) and sensitivity = its relative change against the score before
   the iteration (lines 13-14). The change answers the mask update of the previous iteration, so it goes to
   the layers chosen then (``pending``), whose step follows eq. 11 (lines 16-17):
   ``Δ_l <- clip(Δ_l * (1 + β * sensitivity), min_step, max_step)`` (a negative sensitivity shrinks ``Δ_l``);
5. the evaluated solution (masks and score, :class:`~unsparse.prune.ranked_list.Solution`) enters the ranked list
   of the best ``L`` (lines 18-22);
6. masks of ``C_t`` from importance ``I = |w| + α |G|`` (eq. 12) thresholded to ``s_l + Δ_l`` (eq. 13-14,
   line 24); the last step is scaled so the weighted sparsity (eq. 7-8) lands exactly on the target;
7. if the sensitivity is below ``-epsilon`` (progress not satisfactory, line 25), the previously chosen
   layers are repaired instead of pruning ``C_t``: with probability ``mutation_threshold`` by mutation —
   sparsity lowered by ``r * Δ_l``, ``r ~ U(0, 1)``, reviving the pruned weights of highest importance
   (eq. 15-16) — otherwise by crossover — they take the masks of a random ranked solution (eq. 17-18); then,
   if ``rewind``, every parameter and buffer returns to its value before this iteration's training
   (line 34). The next iteration only trains (nothing pending), so a repair is never judged against the
   score from before the damage, which a rewound model could not reach and would loop on. A crossover donor
   comes from an earlier iteration: the solution just ranked holds the masks that stalled, and copying them
   would repair nothing.

Readings of the text, not switches: the paper lists the rewind (line 34) after the repair's if-block; here it
runs on a stall only, since rewinding after every iteration would undo all training. It restores weights and
buffers, not the optimizer's momentum. A validation score that is not finite (a diverged model: NaN loss or
MSE) counts as the worst possible: it never enters the ranked list, and its relative change is ``-inf`` (a
stall, and ``Δ_l`` at ``min_step``); the change measured against such a score is 0.

Deviations from the paper, each a config value whose constructor default turns it off:

- ``initial_sparsity``: the paper starts from random weights with random masks at a starting sparsity
  (Alg. 2 lines 1-2); here the run starts from the given (trained dense) model, so the first masks are by
  magnitude (eq. 12 with ``G = 0``), which spends none of the iteration budget on what one-shot magnitude
  pruning reaches for free.
- ``deadline``: a floor under each pruning step. Eq. 11 with ``β = 10`` shrinks ``Δ_l`` to ``min_step``
  after a few noisy negative sensitivities, and the paper's 200 epochs (§6.1) can afford crawling at that
  pace; a CPU budget of tens of iterations cannot. With ``deadline = d`` a step adds at least
  ``ceil(missing / max(ceil(d * iterations) - t, 1))`` mask zeros (``missing`` = zeros still needed for
  ``target``), so without stalls the target is met by iteration ``ceil(d * iterations)`` and the iterations
  after it are spare for stalls. The floor is shared over ``C_t`` in proportion to the eq.-11 increments
  ``Δ_l * size_l`` (so sensitivity still sets the split); what ``C_t`` cannot take below
  ``max_layer_sparsity`` goes to all layers in proportion to their remaining room, so it lands on the large
  layers that dominate eq. 7-8 rather than filling a small chosen one.
- ``crossover_max_regress``: eq. 17-18 draw the donor from the whole ranked list, which, ranked by score,
  fills with the early, denser solutions; copying their masks undid most of the pruning in one stall. Donors
  are restricted to ranked solutions whose weighted sparsity is at most this far below the current masks'
  (``1.0``: any, the paper); with no such donor the repair is a mutation.

With ``mask_application="forward"`` (the default), only the effective weight is zeroed where masked; the dense
weight under a mask is kept but not frozen. Its gradient is zero, yet SGD's momentum and weight decay keep moving
it. So a weight revived by mutation or crossover comes back with that drifted dense value, and mutation ranks pruned
weights by it (eq. 12 on ``|w|``).

The run starts from the model as given (normally trained dense) with masks at ``initial_sparsity`` by magnitude,
stops when the weighted sparsity reaches ``target`` or after ``iterations``, then fine-tunes with masks on.

Readings that differ from ``DESIGN.md``'s wording (an audit against the paper, twenty-first session), kept
because the published runs used them:

- By default (``mask_application="forward"``) eq. 9 is applied in the forward pass (the mask parametrization),
  not by setting pruned weights to zero after each optimizer step. So ``G`` is 0 at pruned entries (the gradient
  of a masked weight): ``α |G|`` ranks kept weights only, a mask grown by eq. 13-14 never revives a weight, and
  mutation revives the pruned weights of largest kept ``|w|``, which favours the most recently pruned ones, at
  their old values rather than at 0. ``mask_application="after_step"`` (twenty-second session) is DESIGN.md's
  wording: dense gradients, pruned weights zeroed after each step, ``G`` at every entry, and thresholds over
  every entry, so pruned weights can come back (at 0) by their ``α |G|``.
- A :class:`~unsparse.prune.ranked_list.Solution` keeps masks and score, not weights, optimizer state or ``G``: a
  crossover puts the donor's masks on the current weights.
- The ranked list starts with the initial solution once, not ``L`` copies of it (line 4), so while it holds fewer
  than ``L`` solutions every finite score enters it (crossover donors are still bounded by
  ``crossover_max_regress``). Entering the list is not gated by ``epsilon`` (line 18); ``epsilon`` decides only the
  stall (line 25).
- Mutation's step is ``r * Δ_l`` with ``r ~ U(0, 1)``: the paper's scaling coefficient for it is 1 here, not a
  config value.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.data import DataLoader, RandomSampler
from tqdm.auto import tqdm

from unsparse.atomic import atomic_write_bytes
from unsparse.prune.base import (
    Pruner,
    PruneResult,
    fine_tune_history,
    layer_mapping,
    metric_score,
    optional_rate,
    val_metrics,
)
from unsparse.prune.evolution import crossover_masks, importance, relative_change, resize_mask, share
from unsparse.prune.masks import (
    WeightMask,
    dense_weight,
    prunable_layers,
    pruned_count,
    straight_through,
    zero_pruned_weights,
)
from unsparse.prune.ranked_list import RankedList, Solution
from unsparse.settings import check_choice, check_flag, check_integer, check_number, check_seed
from unsparse.train import (
    Trainer,
    check_loader_generator,
    check_resumable,
    fit_seconds,
    load_checkpoint,
    random_states,
    restore_random_states,
    save_checkpoint,
)

log = logging.getLogger(__name__)

CHECKPOINT = "evolutionary.pt"
LOG = "prune_log.jsonl"
FINE_TUNE_CHECKPOINT = "evolutionary_finetune.pt"
MASK_APPLICATIONS = ("forward", "after_step")
"""Readings of eq. 9 while the iterations train (``EvolutionaryPruner``'s ``mask_application``)."""


class EvolutionaryPruner(Pruner):
    """UnSparse-Opt Algorithm 2 (paper 004 §3.1) as read in DESIGN.md; see the module docstring.

    Args:
        target: weighted sparsity (eq. 7-8) at which the iterations stop.
        iterations: iteration budget.
        batches_per_iteration: training batches per iteration (None: one epoch).
        alpha: weight of the gradient statistics in the importance (eq. 12).
        beta: scale of the sensitivity in the step update (eq. 11).
        epsilon: relative score drop beyond which progress is not satisfactory (line 25).
        ranked_list_length: ``L``, solutions kept in the ranked list.
        unit_step: initial per-layer sparsity step ``Δ_l``: one value, or a mapping layer name -> value.
        min_step, max_step: bounds of ``Δ_l``.
        layers_per_iteration: size of the chosen subset ``C_t``.
        mutation_threshold: probability of mutation rather than crossover on a stall.
        initial_sparsity: per-layer sparsity of the first masks (by magnitude; a deviation, see the module
            docstring).
        max_layer_sparsity: no layer is pruned beyond this (below 1: every layer keeps a weight).
        deadline: fraction of ``iterations`` by which the step floor reaches ``target`` (in ``(0, 1]``; None:
            no floor, the paper). See the module docstring.
        crossover_max_regress: how far (weighted sparsity, eq. 7-8) below the current masks a crossover donor
            may be (``1.0``: any ranked solution, the paper). See the module docstring.
        rewind: rewind the weights on a stall (line 34).
        mask_application: how eq. 9 applies the masks while the iterations train (fine-tuning always masks in the
            forward pass). ``"forward"``: the mask parametrization multiplies each forward's weight, so pruned
            weights get no gradient, ``G`` is 0 there, and the dense weights under the masks keep (drifting) values
            that mutation and crossover revive. ``"after_step"`` (DESIGN.md's "masks applied after each step", the
            paper's "set to zero ... after each batch"): the gradient reaches pruned weights too
            (:func:`~unsparse.prune.masks.straight_through`), they are set to 0 after every optimizer step and
            every mask change (:func:`~unsparse.prune.masks.zero_pruned_weights`), ``G`` covers them, and eq. 13-16
            threshold every entry (:func:`~unsparse.prune.evolution.resize_mask` with ``regrow``), so a pruned
            weight with a large ``α |G|`` comes back, at 0.
        lr: learning rate of the iterations (None: the trainer's).
        fine_tune_epochs: masked fine-tuning epochs after the iterations.
        fine_tune_lr: their learning rate (None: the trainer's).
        seed: seed of the layer choice, mutation and crossover.
        layers: layers to prune (default all prunable).

    Raises:
        ValueError: naming the constant that is out of range or not a number of its kind (an integer for counts, one in
            ``[0, 2^32)`` for ``seed`` (:func:`~unsparse.settings.check_seed`), a bool for ``rewind``; learning rates
            None or > 0 and finite; ``alpha``, ``beta`` and ``crossover_max_regress`` >= 0 and finite; ``unit_step`` a
            finite number > 0 or a mapping of layer names, read as strings, to such numbers); as
            :class:`~unsparse.prune.base.Pruner`.
    """

    name = "evolutionary"
    history_axis = "iteration, then fine-tuning epoch"

    def __init__(self, target: float = 0.9, iterations: int = 100, batches_per_iteration: int | None = None,
                 alpha: float = 0.1, beta: float = 10.0, epsilon: float = 0.005, ranked_list_length: int = 16,
                 unit_step: float | Mapping[str, float] = 0.05, min_step: float = 0.005, max_step: float = 0.2,
                 layers_per_iteration: int = 2, mutation_threshold: float = 0.5, initial_sparsity: float = 0.0,
                 max_layer_sparsity: float = 0.99, deadline: float | None = None,
                 crossover_max_regress: float = 1.0, rewind: bool = True, mask_application: str = "forward",
                 lr: float | None = 0.01,
                 fine_tune_epochs: int = 3, fine_tune_lr: float | None = None, seed: int = 0,
                 layers: list[str] | None = None) -> None:
        super().__init__(target, layers)
        check_number(min_step, "min_step", lambda value: 0.0 < value <= 1.0, "in (0, 1]")
        check_number(max_step, "max_step", lambda value: min_step <= value <= 1.0, f"in [min_step = {min_step}, 1]")
        check_number(max_layer_sparsity, "max_layer_sparsity", lambda value: 0.0 <= value < 1.0,
                     "in [0, 1) (at 1 a layer could lose every weight and pass only its bias)")
        check_number(initial_sparsity, "initial_sparsity", lambda value: 0.0 <= value <= max_layer_sparsity,
                     f"in [0, max_layer_sparsity = {max_layer_sparsity}]")
        check_integer(iterations, "iterations", low=0)
        check_integer(layers_per_iteration, "layers_per_iteration")
        if batches_per_iteration is not None:
            check_integer(batches_per_iteration, "batches_per_iteration")
        if deadline is not None:
            check_number(deadline, "deadline", lambda value: 0.0 < value <= 1.0, "in (0, 1] (or null)")
        check_number(crossover_max_regress, "crossover_max_regress", lambda value: 0.0 <= value < math.inf,
                     ">= 0 and finite (1.0 already admits any donor)")
        check_number(mutation_threshold, "mutation_threshold", lambda value: 0.0 <= value <= 1.0,
                     "in [0, 1] (a probability)")
        for name, value in (("alpha", alpha), ("beta", beta)):  # inf made every importance or score inf or NaN
            check_number(value, name, lambda number: 0.0 <= number < math.inf, ">= 0 and finite")
        # a negative epsilon asks every iteration to improve the score by at least |epsilon| (-inf: every one stalls)
        check_number(epsilon, "epsilon", lambda number: not math.isnan(number), "(not NaN)")
        check_flag(rewind, "rewind")
        self.mask_application = check_choice(mask_application, MASK_APPLICATIONS, "mask_application")
        self.iterations, self.batches_per_iteration = iterations, batches_per_iteration
        self.alpha, self.beta, self.epsilon = alpha, beta, epsilon
        self.ranked, self.ranked_list_length = RankedList(ranked_list_length), ranked_list_length
        # finite like alpha and beta: inf was clipped to max_step unseen and entered the identity as JSON's Infinity
        if isinstance(unit_step, Mapping):
            unit_step = layer_mapping(unit_step, "unit_step", lambda value: 0.0 < value < math.inf, "> 0 and finite")
        else:
            check_number(unit_step, "unit_step", lambda value: 0.0 < value < math.inf, "> 0 and finite (or a mapping)")
        self.unit_step = unit_step
        self.min_step, self.max_step = min_step, max_step
        self.layers_per_iteration, self.mutation_threshold = layers_per_iteration, mutation_threshold
        self.initial_sparsity, self.max_layer_sparsity, self.rewind = initial_sparsity, max_layer_sparsity, rewind
        self.deadline, self.crossover_max_regress = deadline, crossover_max_regress
        self.lr, self.fine_tune_lr = optional_rate(lr, "lr"), optional_rate(fine_tune_lr, "fine_tune_lr")
        self.fine_tune_epochs = check_integer(fine_tune_epochs, "fine_tune_epochs", low=0)
        self.seed = check_seed(seed)
        self.generator = torch.Generator()
        self.grad_stats: dict[str, torch.Tensor] = {}
        self.delta: dict[str, float] = {}
        self.sensitivity: dict[str, float] = {}
        self.chosen: list[str] = []
        self.pending: list[str] = []
        self.iteration = 0
        self.score = -math.inf

    def check_layers(self, model: nn.Module) -> None:
        """:meth:`Pruner.check_layers`; a masked layer's weight must carry no parametrization but the pruner's mask
        (the importance and ``G``, eq. 10 and 12, read the dense weight and its gradient, which e.g. a
        ``weight_norm`` layer keeps as two other tensors); a ``unit_step`` mapping must name prunable layers and give
        every masked layer a step (checked before training in the main job, as :meth:`prepare` needs it); ``target``
        must be within what ``max_layer_sparsity`` lets the masked layers lose (else the run would spend its whole
        budget and stop below it; a layer of no weights, e.g. ``nn.Linear(0, 3)``, has none to lose and counts
        nothing); and the masked layers must hold a weight between them (else there is nothing to prune, and no
        weighted sparsity, eq. 7-8).

        Raises:
            ValueError: naming ``layers`` and the layers with another parametrization or the masked layers when none
                holds a weight, ``unit_step`` and the layers, or ``target`` and ``max_layer_sparsity``.
        """
        super().check_layers(model)
        layers = prunable_layers(model)
        names = self.layer_names if self.layer_names is not None else list(layers)
        sizes = [layers[name].weight.numel() for name in names]
        if not sum(sizes):
            raise ValueError(f"layers: the masked layers {names} hold no weights (0 inputs or outputs); nothing to "
                             "prune")
        needed, allowed = pruned_count(self.target, sum(sizes)), sum(self.max_zeros(size) for size in sizes)
        if needed > allowed:
            raise ValueError(f"target: {self.target} needs {needed} of the {sum(sizes)} masked weights pruned, but "
                             f"max_layer_sparsity {self.max_layer_sparsity} lets the layers lose at most {allowed} "
                             f"(weighted sparsity {allowed / sum(sizes):.6g}); lower target or raise "
                             "max_layer_sparsity")
        foreign = [name for name in names if parametrize.is_parametrized(layers[name], "weight")
                   and not all(isinstance(step, WeightMask) for step in layers[name].parametrizations.weight)]
        if foreign:
            raise ValueError(f"layers: the weights of {foreign} carry a parametrization other than the pruner's mask "
                             "(e.g. weight_norm), and the evolutionary pruner reads the dense weight and its gradient; "
                             "remove it first (torch.nn.utils.parametrize.remove_parametrizations) or leave these "
                             "layers out of layers")
        if isinstance(self.unit_step, dict):
            prunable = list(prunable_layers(model))
            unknown = [name for name in self.unit_step if name not in prunable]
            masked = self.layer_names if self.layer_names is not None else prunable
            missing = [name for name in masked if name not in self.unit_step]
            problems = ([f"{unknown} are not prunable layers of the model (it has {', '.join(prunable)})"]
                        if unknown else []) + (
                [f"no step for the masked layers {missing}"] if missing else [])
            if problems:
                raise ValueError("unit_step: " + "; ".join(problems))

    def shortfall_reason(self) -> str | None:
        """The iteration budget: :meth:`check_layers` refuses a target that ``max_layer_sparsity`` puts out of reach,
        so a run that stops below its target has used up its ``iterations``."""
        return f"its iteration budget of {self.iterations} iterations ran out"

    def prepare(self, model: nn.Module) -> None:
        """Attach masks (:meth:`Pruner.prepare`: a mask already on a layer stays, zeros included) and reset the
        state: ``Δ_l`` to its unit step, ``G`` to zeros, the generator to ``seed``, the ranked list to empty.

        Raises:
            ValueError: from :meth:`check_layers`.
        """
        super().prepare(model)
        layers = prunable_layers(model)
        units = self.unit_step if isinstance(self.unit_step, dict) else dict.fromkeys(self.masks, self.unit_step)
        self.delta = {name: float(min(max(units[name], self.min_step), self.max_step)) for name in self.masks}
        self.sensitivity = dict.fromkeys(self.masks, 0.0)
        self.grad_stats = {name: torch.zeros_like(dense_weight(layers[name])) for name in self.masks}
        self.generator.manual_seed(self.seed)
        self.ranked.solutions = []
        self.chosen, self.pending, self.iteration, self.score = [], [], 0, -math.inf

    def max_zeros(self, size: int) -> int:
        """Most mask zeros a layer of ``size`` weights may have: ``floor(max_layer_sparsity * size)``, below
        ``size``."""
        return math.floor(self.max_layer_sparsity * size)

    def zero_counts(self) -> dict[str, int]:
        """Number of pruned (mask 0) entries per masked layer."""
        return {name: int((mask.mask == 0).sum()) for name, mask in self.masks.items()}

    def mask_sparsity(self) -> dict[str, float]:
        """Per-layer fraction of mask zeros (paper 004 eq. 6); 0.0 for a layer of no weights (its mask is empty)."""
        sizes = self.layer_sizes()
        return {name: count / sizes[name] if sizes[name] else 0.0 for name, count in self.zero_counts().items()}

    def mask_weighted_sparsity(self) -> float:
        """Weighted sparsity of the masks (eq. 7-8): total mask zeros over total masked weights (a layer of no weights
        adds nothing to either; :meth:`check_layers` refuses masked layers that all have none)."""
        return sum(self.zero_counts().values()) / sum(self.layer_sizes().values())

    def target_zeros(self) -> int:
        """Mask zeros that meet ``target``: ``ceil(target * total)`` (a tiny tolerance absorbs float error)."""
        return math.ceil(self.target * sum(self.layer_sizes().values()) - 1e-9)

    def floor_zeros(self) -> int:
        """Fewest mask zeros the next pruning step adds (``deadline`` floor; 0 without a deadline).

        ``ceil(missing / max(ceil(deadline * iterations) - iteration, 1))`` where ``missing`` is the number of
        zeros still needed for :meth:`target_zeros`.
        """
        if self.deadline is None:
            return 0
        missing = max(self.target_zeros() - sum(self.zero_counts().values()), 0)
        return math.ceil(missing / max(math.ceil(self.deadline * self.iterations) - self.iteration, 1))

    @torch.no_grad()
    def step(self) -> None:
        """Prune each layer of ``chosen`` by its ``Δ_l`` on importance ``|w| + α|G|`` (eq. 11-14).

        Unlike the magnitude pruners' ``step``, this is not the whole method: it is the mask update of one
        iteration of Algorithm 2, whose layers ``C_t`` (``chosen``), ``G`` and ``Δ_l`` :meth:`run` draws and
        measures by training and validating (an iteration that stalls prunes nothing and does not call it).
        The total increment is raised to :meth:`floor_zeros` if below it. Mutates the masks; the dense weights
        keep their values. A layer of no weights is left as it is (its step prunes none of its 0 weights, and it has
        no room for the floor).

        Raises:
            RuntimeError: before :meth:`prepare`, after :meth:`squash_mask`, with the masks removed from the model
                since :meth:`prepare` (:func:`~unsparse.prune.masks.remove_masks`), or with no layers chosen (right
                after :meth:`prepare`: nothing would be pruned).
            ValueError: naming ``chosen`` and the names in it that are not masked layers (nothing is pruned then).
        """
        self._prepared()
        if not self.chosen:
            raise RuntimeError(f"{type(self).__name__}.step: no layers chosen (C_t) to prune; an iteration of "
                               "Algorithm 2 chooses them, gathers G and sets the steps by training: call "
                               "run(model, trainer, workdir), or set chosen to masked layers' names first")
        unknown = [name for name in self.chosen if name not in self.masks]
        if unknown:
            raise ValueError(f"chosen: {unknown} are not masked layers; the pruner masks {', '.join(self.masks)}")
        sizes = self.layer_sizes()
        self._grow({name: pruned_count(self.delta[name], sizes[name]) for name in self.chosen}, self.floor_zeros())

    def _grow(self, counts: Mapping[str, int], floor: int) -> None:
        """Add ``counts[l]`` mask zeros to each named layer, at least ``floor`` in total. A step from ``s_l`` to
        ``s_l + Δ_l`` adds the fewest that reach it (eq. 13: ``ceil(Δ_l * size_l)``, as
        :func:`~unsparse.prune.masks.pruned_count` counts); rounding to nearest instead never pruned a layer whose
        step was below half a weight.

        Increments are capped by ``max_layer_sparsity``; a shortfall below ``floor`` is shared in proportion to the
        increments, then over every masked layer in proportion to its remaining room
        (:func:`~unsparse.prune.evolution.share`), no layer growing by more than ``max_step`` of its size in one step
        (the bound of ``Δ_l``; without it a late floor pushed the autoencoder's 48-weight first layer to 98 % in one
        step, and it never recovered); the total is then scaled down so the mask zeros do not pass :meth:`target_zeros`.
        Mutates the masks by importance (eq. 12-14).
        """
        sizes, zeros = self.layer_sizes(), self.zero_counts()
        room = {name: max(self.max_zeros(sizes[name]) - zeros[name], 0) for name in self.masks}
        extra = {name: min(count, room[name]) for name, count in counts.items()}
        needed = max(self.target_zeros() - sum(zeros.values()), 0)
        shortfall = min(floor, needed) - sum(extra.values())
        if shortfall > 0:
            spare = {name: max(min(room[name], math.ceil(self.max_step * sizes[name])) - extra.get(name, 0), 0)
                     for name in self.masks}
            added = share(shortfall, extra, spare)
            extra = {name: extra.get(name, 0) + count for name, count in added.items()
                     if name in extra or count > 0}
        planned = sum(extra.values())
        if planned > needed:
            extra = {name: count * needed // planned for name, count in extra.items()}
            for name in extra:
                top_up = min(room[name] - extra[name], needed - sum(extra.values()))
                extra[name] += top_up
        self._resize({name: zeros[name] + count for name, count in extra.items()})

    @torch.no_grad()
    def mutate(self) -> None:
        """Lower each ``pending`` layer's sparsity by ``r * Δ_l``, ``r ~ U(0, 1)`` (eq. 15-16; mutates masks): revive
        the fewest weights that lower it by at least that, ``ceil(r * Δ_l * size_l)``, as a growth step adds the
        fewest zeros that raise it by at least ``Δ_l`` (:func:`~unsparse.prune.masks.pruned_count`)."""
        sizes, zeros = self.layer_sizes(), self.zero_counts()
        self._resize({name: max(zeros[name] - pruned_count(float(torch.rand((), generator=self.generator))
                                                           * self.delta[name], sizes[name]), 0)
                      for name in self.pending})

    def donor_floor(self) -> float:
        """Least weighted sparsity of a crossover donor: the masks' less ``crossover_max_regress``."""
        return self.mask_weighted_sparsity() - self.crossover_max_regress

    @torch.no_grad()
    def crossover(self) -> int:
        """Give the ``pending`` layers the masks of a random ranked solution (eq. 17-18). Returns its iteration.

        The donor is drawn among the ranked solutions at least :meth:`donor_floor` sparse and evaluated before the
        current iteration (the current one's are the masks being repaired).

        Raises:
            IndexError: when there is no such solution.
        """
        donor = self.ranked.sample(self.generator, self.donor_floor(), self.iteration)
        current = {name: mask.mask.bool() for name, mask in self.masks.items()}
        for name, keep in crossover_masks(current, donor.masks(), self.pending).items():
            self.masks[name].set(keep)
        return donor.iteration

    def _resize(self, pruned: Mapping[str, int]) -> None:
        """Give each named layer exactly ``pruned[name]`` mask zeros by importance ``|w| + α|G|`` (eq. 12-14)."""
        layers = prunable_layers(self._prepared())
        for name, count in pruned.items():
            score = importance(dense_weight(layers[name]), self.grad_stats[name], self.alpha)
            self.masks[name].set(resize_mask(self.masks[name].mask.bool(), score, count, self._after_step()))

    def run(self, model: nn.Module, trainer: Trainer, workdir: str | Path) -> PruneResult:
        """Algorithm 2 then masked fine-tuning; resumes from ``workdir`` if a checkpoint is there.

        Mutates ``model`` (masks stay attached). Appends one JSON line per iteration to
        ``workdir/prune_log.jsonl`` and rewrites ``workdir/evolutionary.pt`` atomically after each; the fine-tuning
        checkpoints in ``workdir/evolutionary_finetune.pt``. Both resume only a run of the same settings
        (:meth:`~unsparse.prune.base.Pruner.identity`); a fresh run removes an old fine-tuning checkpoint.

        Returns:
            A :class:`PruneResult` whose ``history`` has one entry per iteration (``phase: "prune"``) and
            per fine-tuning epoch (``phase: "fine_tune"``), each with ``iteration``, ``weighted_sparsity``,
            ``val_score`` and ``val_top1`` or ``val_mse``. An iteration's entry also counts the weights its mask
            updates brought back (``revived``: by mutation, crossover, or an ``after_step`` regrowth).

        Raises:
            ~unsparse.train.CheckpointRefusedError: (a ``ValueError``) a checkpoint in ``workdir`` written with other
                settings, by an older version (no identity or another entry missing), or for a train loader with
                another kind of shuffle generator, or one that is damaged (:func:`~unsparse.train.load_checkpoint`).
        """
        started = time.perf_counter()
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        model.to(trainer.device)
        self.prepare(model)
        optimizer = trainer.optimizer(model, self.lr)
        checkpoint, log_path = workdir / CHECKPOINT, workdir / LOG
        if checkpoint.exists():
            history, elapsed = self._load(checkpoint, optimizer, trainer, log_path)
        else:
            history, elapsed = [self._begin(trainer)], 0.0
            log_path.unlink(missing_ok=True)
            (workdir / FINE_TUNE_CHECKPOINT).unlink(missing_ok=True)  # a fresh run fine-tunes its own masks
            self._record(history[-1], log_path, checkpoint, optimizer, trainer, history, elapsed, started)
        bar = tqdm(total=self.iterations, initial=self.iteration, desc=self.name, disable=not trainer.progress)
        while self._continues():
            history.append(self._iterate(trainer, optimizer))
            self._record(history[-1], log_path, checkpoint, optimizer, trainer, history, elapsed, started)
            _log_iteration(self.name, history[-1])
            bar.update(1)
            bar.set_postfix(ws=f"{history[-1]['next_weighted_sparsity']:.4f}",
                            score=f"{history[-1]['val_score']:.4g}")
        bar.close()
        elapsed += time.perf_counter() - started
        tuned = trainer.fit(model, self.fine_tune_epochs, workdir / FINE_TUNE_CHECKPOINT, lr=self.fine_tune_lr,
                            desc=f"{self.name} fine-tune", identity=self.identity())
        history += fine_tune_history(tuned, self.mask_weighted_sparsity(), self.iteration)
        return self.result(history, elapsed + fit_seconds(tuned))

    def _continues(self) -> bool:
        eligible = any(zeros < self.max_zeros(size)
                       for zeros, size in zip(self.zero_counts().values(), self.layer_sizes().values(), strict=True))
        return (self.iteration < self.iterations and sum(self.zero_counts().values()) < self.target_zeros()
                and eligible)

    def _begin(self, trainer: Trainer) -> dict[str, Any]:
        """Initial masks by magnitude at ``initial_sparsity``; evaluate; seed the ranked list (lines 1-7).

        A layer whose mask :meth:`prepare` found already on it (another pruner's, or an earlier run's) keeps its
        zeros and is pruned further only up to ``initial_sparsity``, not by it (under ``"after_step"`` its dense
        weights under the zeros are set to 0 first, so no threshold revives them).
        """
        self._zero_pruned()
        sizes, zeros = self.layer_sizes(), self.zero_counts()
        counts = {name: pruned_count(self.initial_sparsity, sizes[name]) - zeros[name] for name in self.masks}
        self._grow({name: count for name, count in counts.items() if count > 0}, 0)
        self._zero_pruned()
        metrics = trainer.evaluate(self._prepared(), "val")
        self.score = metric_score(metrics)
        self._offer(self.score)
        return {"phase": "prune", "iteration": 0, "weighted_sparsity": self.mask_weighted_sparsity(),
                "next_weighted_sparsity": self.mask_weighted_sparsity(), "layer_sparsity": self.mask_sparsity(),
                "delta": dict(self.delta), "sensitivity": dict(self.sensitivity), "chosen": [], "events": [],
                "revived": 0, **val_metrics(metrics)}

    def _iterate(self, trainer: Trainer, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """One iteration of Algorithm 2 (lines 10-34); mutates model, masks, optimizer and state.

        ``chosen`` is emptied on a stall, so its log entry lists the layers actually pruned.
        """
        model = self._prepared()
        self.iteration += 1
        self.chosen = self._choose()
        before = {key: value.detach().clone() for key, value in model.state_dict().items()}
        train_loss = self._train(trainer, optimizer)
        metrics = trainer.evaluate(model, "val")
        score = metric_score(metrics)
        sensitivity = relative_change(score, self.score)
        growth = 1.0 + self.beta * sensitivity if self.beta else 1.0  # beta 0 with an infinite change: no NaN
        for name in self.pending:
            self.sensitivity[name] = sensitivity
            self.delta[name] = min(max(self.delta[name] * growth, self.min_step), self.max_step)
        evaluated = {"weighted_sparsity": self.mask_weighted_sparsity(), "layer_sparsity": self.mask_sparsity()}
        pruned_before = {name: mask.mask == 0 for name, mask in self.masks.items()}
        events = ["ranked"] if self._offer(score) else []
        if sensitivity < -self.epsilon and self.pending:
            donors = self.ranked.candidates(self.donor_floor(), self.iteration)
            if not donors or float(torch.rand((), generator=self.generator)) < self.mutation_threshold:
                self.mutate()
                events.append("mutation")
            else:
                events.append(f"crossover:{self.crossover()}")
            if self.rewind:
                self._rewind(before)
                events.append("rewind")
            self.chosen = []
        if self.chosen:
            self.step()
        self._zero_pruned()
        self.score = score
        self.pending = self.chosen
        revived = sum(int((pruned_before[name] & (mask.mask != 0)).sum()) for name, mask in self.masks.items())
        return {"phase": "prune", "iteration": self.iteration, **evaluated,
                "next_weighted_sparsity": self.mask_weighted_sparsity(),
                "next_layer_sparsity": self.mask_sparsity(), "delta": dict(self.delta),
                "sensitivity": dict(self.sensitivity), "relative_change": sensitivity, "chosen": self.chosen,
                "events": events, "revived": revived, "train_loss": train_loss, **val_metrics(metrics)}

    def _choose(self) -> list[str]:
        """Draw ``C_t`` without replacement, weights ``size_l * (max_layer_sparsity - s_l)`` (line 10): a layer with
        no room left, such as a layer of no weights, is never drawn."""
        sizes, zeros = self.layer_sizes(), self.zero_counts()
        names = list(self.masks)
        weights = torch.tensor([max(self.max_zeros(sizes[n]) - zeros[n], 0) for n in names],
                               dtype=torch.float64)
        count = min(self.layers_per_iteration, int((weights > 0).sum()))
        picked = torch.multinomial(weights, count, replacement=False, generator=self.generator)
        return [names[i] for i in sorted(picked.tolist())]

    def _train(self, trainer: Trainer, optimizer: torch.optim.Optimizer) -> float:
        """Masked training (eq. 9, as ``mask_application`` reads it) gathering ``G`` = mean ``|grad|`` of the dense
        weights (eq. 10).

        ``"forward"``: the gradient of a dense weight is the masked gradient, so ``G`` is 0 at pruned entries.
        ``"after_step"``: the gradient is the dense one, and pruned weights are set to 0 after every step.
        """
        layers = prunable_layers(self._prepared())
        totals = {name: torch.zeros_like(stat) for name, stat in self.grad_stats.items()}
        steps = 0

        def after_step() -> None:
            nonlocal steps
            steps += 1
            for name, total in totals.items():
                grad = dense_weight(layers[name]).grad
                if grad is not None:
                    total.add_(grad.abs())
            self._zero_pruned()

        with straight_through(self.masks.values() if self._after_step() else ()):
            loss = self._iteration_trainer(trainer).train_epoch(self._prepared(), optimizer, after_step,
                                                                 desc=f"{self.name} iteration {self.iteration}")
        self.grad_stats = {name: total / max(steps, 1) for name, total in totals.items()}
        return loss

    def _after_step(self) -> bool:
        return self.mask_application == "after_step"

    def _zero_pruned(self) -> None:
        """Under ``"after_step"``, set the dense weights under mask zeros to 0 (eq. 9 on the stored weights)."""
        if self._after_step():
            zero_pruned_weights(self._prepared())

    def _iteration_trainer(self, trainer: Trainer) -> Trainer:
        """``trainer``, or a copy whose train loader draws ``batches_per_iteration`` random batches (with the
        original loader's collation, workers, memory pinning and last-batch setting)."""
        if self.batches_per_iteration is None:
            return trainer
        loader = trainer.loaders["train"]
        sampler = RandomSampler(loader.dataset, num_samples=self.batches_per_iteration * loader.batch_size,
                                generator=loader.generator)
        batches = DataLoader(loader.dataset, batch_size=loader.batch_size, sampler=sampler,
                             collate_fn=loader.collate_fn, num_workers=loader.num_workers,
                             pin_memory=loader.pin_memory, drop_last=loader.drop_last,
                             worker_init_fn=loader.worker_init_fn)
        return dataclasses.replace(trainer, loaders={**trainer.loaders, "train": batches})

    @torch.no_grad()
    def _rewind(self, before: dict[str, torch.Tensor]) -> None:
        """Restore parameters and buffers from ``before`` but keep the current masks (line 34)."""
        masks = {name: mask.mask.clone() for name, mask in self.masks.items()}
        self._prepared().load_state_dict(before)
        for name, keep in masks.items():
            self.masks[name].set(keep)

    def _offer(self, score: float) -> bool:
        """Pack the current masks and offer them to the ranked list, if it would enter."""
        if not self.ranked.accepts(score):
            return False
        return self.ranked.offer(Solution.from_masks(score, self.iteration, self.mask_weighted_sparsity(),
                                                     {name: mask.mask for name, mask in self.masks.items()}))

    def _record(self, entry: dict[str, Any], log_path: Path, checkpoint: Path, optimizer: torch.optim.Optimizer,
                trainer: Trainer, history: list[dict[str, Any]], elapsed: float, started: float) -> None:
        """Append ``entry`` to the log, then checkpoint the whole state atomically (the history, which the log is
        set to on a resume: :meth:`_load`)."""
        with open(log_path, "a", encoding="utf-8") as log_file:
            log_file.write(log_line(entry))
        generator = trainer.loaders["train"].generator
        save_checkpoint(checkpoint, {
            "model": self._prepared().state_dict(), "optimizer": optimizer.state_dict(),
            "grad_stats": self.grad_stats, "delta": self.delta, "sensitivity": self.sensitivity,
            "pending": self.pending, "ranked": self.ranked.state(), "iteration": self.iteration,
            "score": self.score, "history": history,
            **random_states(), "generator": self.generator.get_state(),
            "loader_rng": generator.get_state() if generator is not None else torch.empty(0),
            "elapsed_s": elapsed + time.perf_counter() - started, "identity": self.identity()})

    def _load(self, checkpoint: Path, optimizer: torch.optim.Optimizer, trainer: Trainer,
              log_path: Path) -> tuple[list[dict[str, Any]], float]:
        """Restore the state written by :meth:`_record`; the log is set to the checkpoint's history (one line per
        entry): lines of an iteration the checkpoint does not hold are cut, and a log shorter than the history (a
        crash of the machine before the appended lines reached the disk) or missing is rebuilt, with a warning."""
        state = load_checkpoint(checkpoint, required=("model", "optimizer", "grad_stats", "delta", "sensitivity",
                                                      "pending", "ranked", "iteration", "score", "history",
                                                      "generator", "loader_rng", "elapsed_s"))
        check_resumable(checkpoint, state, self.identity())
        check_loader_generator(checkpoint, state["loader_rng"], trainer.loaders["train"].generator)
        device = trainer.device
        self._prepared().load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        self.grad_stats = {name: stat.to(device) for name, stat in state["grad_stats"].items()}
        self.delta, self.sensitivity, self.pending = state["delta"], state["sensitivity"], state["pending"]
        self.ranked.load_state(state["ranked"])
        self.iteration, self.score = state["iteration"], state["score"]
        restore_random_states(state)
        self.generator.set_state(state["generator"])
        generator = trainer.loaders["train"].generator
        if generator is not None:
            generator.set_state(state["loader_rng"])
        expected = "".join(map(log_line, state["history"])).encode()
        current = log_path.read_bytes() if log_path.exists() else None
        if current is None or not current.startswith(expected):
            log.warning("%s: %s; rebuilt from the checkpoint's history (%d entries)", log_path,
                        "missing" if current is None else "shorter than or different from the checkpoint's history",
                        len(state["history"]))
        if current != expected:
            atomic_write_bytes(log_path, expected)
        log.info("resumed evolutionary pruning from %s after iteration %d", checkpoint, self.iteration)
        return state["history"], state["elapsed_s"]


def log_line(entry: Mapping[str, Any]) -> str:
    """One history entry as a line of ``prune_log.jsonl``."""
    return json.dumps(entry) + "\n"


def _log_iteration(name: str, entry: Mapping[str, Any]) -> None:
    """One INFO line per iteration (the job's log has it with progress bars off too): weighted sparsity evaluated and
    next, validation score, events."""
    log.info("%s iteration %d: weighted sparsity %.4f (next %.4f), val score %.4g, events %s", name,
             entry["iteration"], entry["weighted_sparsity"], entry["next_weighted_sparsity"], entry["val_score"],
             ", ".join(entry["events"]) or "none")
