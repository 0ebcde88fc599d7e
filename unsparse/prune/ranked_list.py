"""The ranked list of UnSparse-Opt (paper 004 Algorithm 2, lines 18-22): the best solutions so far by validation
score, each kept as bit-packed masks, from which crossover (eq. 17-18) draws its donors.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from unsparse.prune.masks import pack_mask, unpack_mask
from unsparse.settings import check_integer


@dataclass
class Solution:
    """One entry of the ranked list (paper 004 Alg. 2 lines 19-21), held on the CPU.

    The paper writes the weights into the list too; no step of Algorithm 2 reads them back (crossover,
    eq. 17-18, takes masks only), so they are not kept: 16 copies of a torchvision model's weights would take
    gigabytes and be rewritten to every checkpoint. Masks are kept bit-packed (:func:`~unsparse.prune.masks.pack_mask`).

    Attributes:
        score: validation score, higher is better (top-1 %, or ``-MSE``).
        iteration: the iteration that produced it.
        weighted_sparsity: eq. 7-8 of its masks.
        packed_masks: per layer, the keep-mask as :func:`~unsparse.prune.masks.pack_mask` bits (``uint8``).
        shapes: per layer, the mask's (the weight's) shape.
    """

    score: float
    iteration: int
    weighted_sparsity: float
    packed_masks: dict[str, torch.Tensor]
    shapes: dict[str, list[int]]

    @classmethod
    def from_masks(cls, score: float, iteration: int, weighted_sparsity: float,
                   masks: Mapping[str, torch.Tensor]) -> Solution:
        """A solution holding ``masks`` (bool or 0/1 tensors of the weights' shapes, any device) packed."""
        return cls(score, iteration, weighted_sparsity, {name: pack_mask(keep) for name, keep in masks.items()},
                   {name: list(keep.shape) for name, keep in masks.items()})

    def masks(self) -> dict[str, torch.Tensor]:
        """The keep-masks, unpacked: bool tensors of the weights' shapes, on the CPU."""
        return {name: unpack_mask(bits, self.shapes[name]) for name, bits in self.packed_masks.items()}


class RankedList:
    """The best ``length`` solutions by score, best first (paper 004 Alg. 2 lines 18-22).

    Ties keep the earlier solution ahead. Mutated by :meth:`offer` and :meth:`load_state`.
    """

    def __init__(self, length: int) -> None:
        self.length = check_integer(length, "ranked_list_length")
        self.solutions: list[Solution] = []

    def __len__(self) -> int:
        return len(self.solutions)

    def accepts(self, score: float) -> bool:
        """Whether a solution of ``score`` would enter: a finite score (NaN compares false with everything and
        would stay last forever, blocking every later entry) and the list not full, or better than the worst."""
        return math.isfinite(score) and (len(self.solutions) < self.length or score > self.solutions[-1].score)

    def offer(self, solution: Solution) -> bool:
        """Insert ``solution`` if :meth:`accepts`; drop the worst beyond ``length``. Returns whether it entered."""
        if not self.accepts(solution.score):
            return False
        position = next((i for i, kept in enumerate(self.solutions) if solution.score > kept.score),
                        len(self.solutions))
        self.solutions.insert(position, solution)
        del self.solutions[self.length:]
        return True

    def candidates(self, min_sparsity: float = 0.0, before_iteration: int | None = None) -> list[Solution]:
        """Solutions whose weighted sparsity is at least ``min_sparsity`` (and, if given, evaluated in an
        iteration before ``before_iteration``), best first."""
        return [solution for solution in self.solutions if solution.weighted_sparsity >= min_sparsity
                and (before_iteration is None or solution.iteration < before_iteration)]

    def sample(self, generator: torch.Generator, min_sparsity: float = 0.0,
               before_iteration: int | None = None) -> Solution:
        """A uniformly random solution among :meth:`candidates` (crossover partner).

        Raises:
            IndexError: when no solution qualifies.
        """
        pool = self.candidates(min_sparsity, before_iteration)
        if not pool:
            raise IndexError(f"no ranked solution with weighted sparsity >= {min_sparsity} before iteration "
                             f"{before_iteration}")
        return pool[int(torch.randint(len(pool), (), generator=generator))]

    def state(self) -> list[dict[str, Any]]:
        """Plain containers of tensors for a checkpoint; the tensors are the solutions' own (not copied: a
        solution is never changed after :meth:`offer`, and ``dataclasses.asdict`` would deep-copy every one of
        them at every checkpoint)."""
        return [{field.name: getattr(solution, field.name) for field in dataclasses.fields(solution)}
                for solution in self.solutions]

    def load_state(self, state: list[dict[str, Any]]) -> None:
        """Replace the contents with a :meth:`state`.

        Raises:
            ValueError: an entry's fields are not :class:`Solution`'s (a checkpoint written before the ranked list
                kept bit-packed masks instead of model states); the message names them.
        """
        expected = {field.name for field in dataclasses.fields(Solution)}
        for entry in state:
            if set(entry) != expected:
                raise ValueError(f"ranked: checkpoint entry has fields {sorted(entry)}, expected {sorted(expected)} "
                                 "(written by an older version; start the run in a new working directory)")
        self.solutions = [Solution(**entry) for entry in state]
