"""Compression flags: ``'stage:arg,stage:arg'`` -> a transform.

Stages apply left to right (:func:`chain`); a single stage gives the transform
itself. Built-in stages (:data:`STAGE_FORMS`; defaults in parentheses):
``identity``, ``intrinsic_projection:d[:K[:seed]]`` (K = 1,
:func:`parse_chain`'s seed), ``uniform_quantization:bits``,
``terngrad[:clip_std|none]`` (2.5), ``top_k:k[:log2|none]`` (log2; no error
feedback), ``count_sketch:rows:cols[:seed]``.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from fedlite_jax.transforms import (
    base, intrinsic, sketch, ternary, topk, uniform)

__all__ = ['STAGE_FORMS', 'parse_chain', 'register_stage']

Builder = Callable[[Sequence[str], int, str], base.CommTransform]
"""``build(args, seed, generator)``; ``args`` are the stage's strings."""

STAGE_FORMS: list[str] = []
"""The registered stages' argument forms (``[...]`` = optional)."""

# name -> (form, min args, max args, builder)
_STAGES: dict[str, tuple[str, int, int, Builder]] = {}


def register_stage(form: str, build: Builder, *, replace: bool = False) -> None:
  """Adds the stage ``form`` (e.g. ``'top_k:k[:log2|none]'``) to the vocabulary.

  Args:
    form: name, then one ``:`` per argument, optional from the first ``[``.
    build: a :data:`Builder`; its ``ValueError`` / ``TypeError`` becomes the
      bad-stage message.
    replace: allow replacing a stage of the same name.

  Raises:
    ValueError: a duplicate name without ``replace``, or an empty name.
  """
  name = form.split('[')[0].split(':')[0].strip()
  if not name:
    raise ValueError(f'stage form {form!r} has no name.')
  if name in _STAGES and not replace:
    raise ValueError(f'stage {name!r} is already registered '
                     '(replace=True to replace it).')
  if name in _STAGES:
    STAGE_FORMS[STAGE_FORMS.index(_STAGES[name][0])] = form
  else:
    STAGE_FORMS.append(form)
  _STAGES[name] = (form, form.split('[')[0].count(':'), form.count(':'), build)


def _int(text: str, name: str) -> int:
  """``int(text)``, or a ``ValueError`` naming ``name``."""
  try:
    return int(text)
  except ValueError:
    raise ValueError(f'{name} must be an integer, got {text!r}') from None


def _intrinsic(args, seed, generator):
  del generator
  d = _int(args[0], 'd')
  k = _int(args[1], 'K') if len(args) > 1 else 1
  s = _int(args[2], 'seed') if len(args) > 2 else seed
  return intrinsic.intrinsic_projection(d, num_subspaces=k, seed=s)


def _terngrad(args, seed, generator):
  del seed
  if not args:
    return ternary.terngrad(generator=generator)
  if args[0] == 'none':
    return ternary.terngrad(clip_std=None, generator=generator)
  try:
    clip_std = float(args[0])
  except ValueError:
    clip_std = math.nan
  if not math.isfinite(clip_std):
    raise ValueError(f"clip_std must be a finite number or 'none', got "
                     f'{args[0]!r}')
  return ternary.terngrad(clip_std=clip_std, generator=generator)


def _count_sketch(args, seed, generator):
  del generator
  s = _int(args[2], 'seed') if len(args) > 2 else seed
  return sketch.count_sketch(_int(args[0], 'rows'), _int(args[1], 'cols'),
                             seed=s)


register_stage('identity', lambda args, seed, generator: base.identity())
register_stage('intrinsic_projection:d[:K[:seed]]', _intrinsic)
register_stage('uniform_quantization:bits',
               lambda args, seed, generator: uniform.uniform_quantization(
                   _int(args[0], 'bits'), generator=generator))
register_stage('terngrad[:clip_std|none]', _terngrad)
register_stage('top_k:k[:log2|none]', lambda args, seed, generator: topk.top_k(
    _int(args[0], 'k'), index_bits=args[1] if len(args) > 1 else 'log2'))
register_stage('count_sketch:rows:cols[:seed]', _count_sketch)


def _stage(text: str, seed: int, generator: str) -> base.CommTransform:
  """One stage's transform; ``ValueError`` for a bad name or arguments."""
  name, *args = [part.strip() for part in text.split(':')]
  if name not in _STAGES:
    raise ValueError(f'unknown stage {name!r}')
  _, lo, hi, build = _STAGES[name]
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
    spec: comma-separated stages (spaces around separators are ignored).
    seed: seed of ``intrinsic_projection`` / ``count_sketch`` stages that
      give none (a protocol constant; costs no bits).
    generator: the quantizer stages' generator (``'hash'``, ``'threefry'``).

  Raises:
    ValueError: (one line, naming the bad stage and listing
      :data:`STAGE_FORMS`) an empty spec or stage, an unknown name, a wrong
      argument count, or an argument the transform refuses.
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
