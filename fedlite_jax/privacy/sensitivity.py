"""Where the clip sits relative to compression: the sensitivity rule.

DP-FedAvg's guarantee needs each client's contribution to the aggregated sum
to have L2 norm at most ``C``. Two orders:

* ``'decoded'`` (default, always valid): clip the decoded contribution in the
  space where the server aggregates, after encode/decode. The sensitivity is
  ``C`` whatever the chain. For the static IGC subspace (aggregation of the
  ``d``-dimensional update) that space is ``R^d``: clip and noise act on
  ``d`` numbers instead of ``D``.
* ``'before_encode'``: clip, then encode/decode. Valid only when every stage
  cannot grow the norm: ``identity`` and ``top_k`` (it keeps a subset of the
  coordinates). Stochastic quantizers (``uniform_quantization``,
  ``terngrad``), ``count_sketch`` and ``intrinsic_projection`` (a Fastfood
  matrix, not an isometry) can, and an unknown (user-registered) stage is
  assumed to; such an order is refused with one line naming the stage.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Union

import jax
import numpy as np
from fedlite_jax.common import PyTree

__all__ = [
    'CLIP_POSITIONS',
    'NORM_NONINCREASING_STAGES',
    'Sensitivity',
    'clip_sensitivity',
    'stage_names',
]

CLIP_POSITIONS = ('decoded', 'before_encode')

NORM_NONINCREASING_STAGES = frozenset({'identity', 'top_k'})
"""Stages whose decode(encode(x)) has norm <= ``||x||`` for every ``x``."""


class Sensitivity(NamedTuple):
  """What :func:`clip_sensitivity` states.

  Attributes:
    bound: L2 sensitivity of one client's contribution to the sum (units of
      the aggregated tree): ``C``.
    clip: where the clip sits (``'decoded'`` or ``'before_encode'``).
    noise_size: number of scalars of the aggregated tree (the noise draws
      per round), or None if no example tree was given.
  """
  bound: float
  clip: str
  noise_size: Optional[int]


def stage_names(stages: Union[str, Sequence[str]]) -> tuple[str, ...]:
  """Stage names of a stage string (``'top_k:10,uniform_quantization:8'``).

  A sequence of stage strings or names is also accepted.
  """
  if isinstance(stages, str):
    stages = [s for s in stages.split(',') if s.strip()]
  return tuple(s.split(':')[0].strip() for s in stages)


def clip_sensitivity(stages: Union[str, Sequence[str]], clip_norm: float,
                     clip: str = 'decoded',
                     aggregated: Optional[PyTree] = None) -> Sensitivity:
  """The sensitivity of the clipped contribution, or a one-line refusal.

  Args:
    stages: the compression chain as a stage string (as for
      :func:`fedlite_jax.transforms.parse_chain`) or a sequence of stage
      names; ``''`` or ``()`` is no compression.
    clip_norm: ``C`` > 0.
    clip: ``'decoded'`` (clip after decode, in the aggregation space) or
      ``'before_encode'`` (clip, then compress).
    aggregated: optional example of the tree the server sums (arrays or
      ``jax.ShapeDtypeStruct``; for the static IGC subspace the ``d``-vector)
      to report the noise size.

  Returns:
    A :class:`Sensitivity` with ``bound = C``.

  Raises:
    ValueError: (one line) ``C <= 0``, an unknown ``clip``, or
      ``'before_encode'`` with a stage that can grow the norm (named).
  """
  if not clip_norm > 0:
    raise ValueError(f'clip_norm C must be > 0; got {clip_norm}.')
  if clip not in CLIP_POSITIONS:
    raise ValueError(f'clip must be one of {CLIP_POSITIONS}; got {clip!r}.')
  names = stage_names(stages)
  if clip == 'before_encode':
    for name in names:
      if name not in NORM_NONINCREASING_STAGES:
        raise ValueError(
            f'clip before encode is refused: stage {name!r} can grow the '
            f'norm past C, so the sensitivity is not C; clip the decoded '
            f"contribution (clip='decoded') instead.")
  noise_size = None
  if aggregated is not None:
    noise_size = int(sum(int(np.prod(np.shape(x)))
                         for x in jax.tree.leaves(aggregated)))
  return Sensitivity(float(clip_norm), clip, noise_size)
