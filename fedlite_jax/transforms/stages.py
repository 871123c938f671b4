"""One flag vocabulary for compression: ``'stage:arg,stage:arg'`` -> transform.

A compression pipeline is written as comma-separated stages, applied left to
right (:func:`fedlite_jax.transforms.chain`); a stage is the name of a
transform function of :mod:`fedlite_jax.transforms` followed by its
positional arguments, separated by ``:``::

  intrinsic_projection:4096,uniform_quantization:8   # 32 D / (8 * 4096 + 64)
  top_k:12000,uniform_quantization:8                 # k values at 8 bits
  uniform_quantization:16
  terngrad
  identity

Stages and their argument forms (:data:`STAGE_FORMS`):

* ``identity`` -- :func:`~fedlite_jax.transforms.identity` (32 bits/float).
* ``intrinsic_projection:d[:K[:seed]]`` --
  :func:`~fedlite_jax.transforms.intrinsic_projection` with intrinsic
  dimension d, K subspaces (default 1), subspace seed (default: the
  ``seed`` argument of :func:`parse_chain`).
* ``uniform_quantization:bits`` --
  :func:`~fedlite_jax.transforms.uniform_quantization` (1..32 bits).
* ``terngrad[:clip_std|none]`` -- :func:`~fedlite_jax.transforms.terngrad`
  (clip at 2.5 std by default; ``none`` = no clipping).
* ``top_k:k[:log2|none]`` -- :func:`~fedlite_jax.transforms.top_k` (index
  bits ``log2`` by default), without error feedback.
* ``count_sketch:rows:cols[:seed]`` --
  :func:`~fedlite_jax.transforms.count_sketch`.

A single stage gives that transform itself (not a one-stage chain, whose
key use differs), so ``uniform_quantization:8`` is exactly
``uniform_quantization(8)``. Pure: no FedJAX.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from fedlite_jax.transforms import base
from fedlite_jax.transforms import intrinsic
from fedlite_jax.transforms import quantize
from fedlite_jax.transforms import sketch
from fedlite_jax.transforms import topk

__all__ = ['STAGE_FORMS', 'parse_chain']

STAGE_FORMS = (
    'identity',
    'intrinsic_projection:d[:K[:seed]]',
    'uniform_quantization:bits',
    'terngrad[:clip_std|none]',
    'top_k:k[:log2|none]',
    'count_sketch:rows:cols[:seed]',
)
"""The allowed stages with their argument forms (``[...]`` = optional)."""

_Builder = Callable[[Sequence[str], int, str], base.CommTransform]


def _int(text: str, name: str) -> int:
  try:
    return int(text)
  except ValueError:
    raise ValueError(f'{name} must be an integer, got {text!r}') from None


def _identity(args, seed, generator):
  del args, seed, generator
  return base.identity()


def _intrinsic(args, seed, generator):
  del generator
  d = _int(args[0], 'd')
  k = _int(args[1], 'K') if len(args) > 1 else 1
  s = _int(args[2], 'seed') if len(args) > 2 else seed
  return intrinsic.intrinsic_projection(d, num_subspaces=k, seed=s)


def _uniform(args, seed, generator):
  del seed
  return quantize.uniform_quantization(_int(args[0], 'bits'),
                                       generator=generator)


def _terngrad(args, seed, generator):
  del seed
  if not args:
    return quantize.terngrad(generator=generator)
  if args[0] == 'none':
    return quantize.terngrad(clip_std=None, generator=generator)
  try:
    clip_std = float(args[0])
  except ValueError:
    clip_std = math.nan
  if not math.isfinite(clip_std):
    raise ValueError(f"clip_std must be a finite number or 'none', got "
                     f'{args[0]!r}')
  return quantize.terngrad(clip_std=clip_std, generator=generator)


def _top_k(args, seed, generator):
  del seed, generator
  index_bits = args[1] if len(args) > 1 else 'log2'
  return topk.top_k(_int(args[0], 'k'), index_bits=index_bits)


def _count_sketch(args, seed, generator):
  del generator
  s = _int(args[2], 'seed') if len(args) > 2 else seed
  return sketch.count_sketch(_int(args[0], 'rows'), _int(args[1], 'cols'),
                             seed=s)


# name -> (min args, max args, builder)
_STAGES: dict[str, tuple[int, int, _Builder]] = {
    'identity': (0, 0, _identity),
    'intrinsic_projection': (1, 3, _intrinsic),
    'uniform_quantization': (1, 1, _uniform),
    'terngrad': (0, 1, _terngrad),
    'top_k': (1, 2, _top_k),
    'count_sketch': (2, 3, _count_sketch),
}


def _stage(text: str, seed: int, generator: str) -> base.CommTransform:
  name, *args = [part.strip() for part in text.split(':')]
  if name not in _STAGES:
    raise ValueError(f'unknown stage {name!r}')
  lo, hi, build = _STAGES[name]
  if not lo <= len(args) <= hi:
    want = (f'{lo}' if lo == hi else f'{lo} to {hi}')
    raise ValueError(f'{name} takes {want} argument(s), got {len(args)}')
  if any(not a for a in args):
    raise ValueError('empty argument')
  return build(args, seed, generator)


def parse_chain(spec: str, *, seed: int = 0,
                generator: str = 'hash') -> base.CommTransform:
  """The transform a stage string describes (see the module docstring).

  Args:
    spec: comma-separated stages, e.g.
      ``'intrinsic_projection:4096,uniform_quantization:8'`` (spaces around
      separators are ignored).
    seed: default seed of ``intrinsic_projection`` / ``count_sketch`` stages
      that give none (a protocol constant both sides know; costs no bits).
    generator: random generator of the quantizer stages (``'hash'`` or
      ``'threefry'``, see :mod:`fedlite_jax.quantization`).

  Returns:
    The single stage's transform, or :func:`~fedlite_jax.transforms.chain`
    of the stages.

  Raises:
    ValueError: (one line) an empty spec or stage, an unknown stage name, a
      wrong number of arguments, or an argument the transform refuses (e.g.
      ``uniform_quantization:40``); the message names the bad stage and
      lists :data:`STAGE_FORMS`.
  """
  if not isinstance(spec, str):
    raise ValueError(f'compression stages must be a string, got {spec!r}.')
  stages = []
  for text in spec.split(','):
    try:
      if not text.strip():
        raise ValueError('empty stage')
      stages.append(_stage(text.strip(), seed, generator))
    except (ValueError, TypeError) as e:
      reason = ' '.join(str(e).split()).rstrip('.')
      raise ValueError(
          f'bad compression stage {text.strip()!r} in {spec!r}: {reason}. '
          f'Allowed stages (comma-separated, applied left to right): '
          f'{", ".join(STAGE_FORMS)}.') from None
  return stages[0] if len(stages) == 1 else base.chain(*stages)
