"""Seed statistics for the results files: mean ± std and paired sign tests.

A claim in ``experiments/results/`` rests on several seeds (same seed = same
initialisation and cohorts across the compared configurations). Each run is
summarised by the mean of its last evaluations (``tail_mean``), the seeds by
mean and sample standard deviation (``summarize``), and a comparison of two
configurations by the per-seed differences and how many of them share the
sign of their mean (``paired``).
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from fedlite_jax.training import round_metrics

#: Evaluations averaged per run (the mean of the last 3, not the last one).
TAIL = 3


def tail_mean(curve: Sequence[Mapping[str, float]], key: str,
              k: int = TAIL) -> float:
  """Mean of ``key`` over the last ``k`` rows of ``curve`` that have it.

  Raises:
    ValueError: no row of ``curve`` has ``key``, or ``k < 1``.
  """
  if k < 1:
    raise ValueError(f'k={k}: the number of evaluations must be >= 1.')
  values = [float(r[key]) for r in curve if key in r]
  if not values:
    raise ValueError(f'no evaluation row has {key!r}; rows have '
                     f'{sorted(curve[0]) if curve else "nothing"}.')
  tail = values[-k:]
  return sum(tail) / len(tail)


def summarize(values: Sequence[float]) -> dict:
  """``{'n', 'mean', 'std', 'values'}``; ``std`` is the sample standard
  deviation (ddof = 1), 0.0 for one value.

  Raises:
    ValueError: ``values`` is empty or holds a non-finite number.
  """
  values = [float(v) for v in values]
  if not values or not all(math.isfinite(v) for v in values):
    raise ValueError(f'values={values}: need at least one finite number.')
  n = len(values)
  mean = sum(values) / n
  var = sum((v - mean) ** 2 for v in values) / (n - 1) if n > 1 else 0.0
  return {'n': n, 'mean': mean, 'std': math.sqrt(var), 'values': values}


def paired(a: Mapping[int, float], b: Mapping[int, float]) -> dict:
  """Per-seed ``a - b`` over the seeds both hold.

  Returns:
    ``{'seeds', 'diffs', 'n', 'mean', 'std', 'agree'}``: ``agree`` counts
    the differences whose sign equals the sign of their mean (a zero
    difference agrees with nothing).

  Raises:
    ValueError: the two share no seed.
  """
  seeds = sorted(set(a) & set(b))
  if not seeds:
    raise ValueError(f'no common seed: {sorted(a)} vs {sorted(b)}.')
  diffs = [float(a[s]) - float(b[s]) for s in seeds]
  s = summarize(diffs)
  sign = (s['mean'] > 0) - (s['mean'] < 0)
  agree = sum(((d > 0) - (d < 0)) == sign != 0 for d in diffs)
  return {'seeds': seeds, 'diffs': diffs, 'n': s['n'], 'mean': s['mean'],
          'std': s['std'], 'agree': agree}


def fmt(summary: Mapping, digits: int = 3, scale: float = 1.0) -> str:
  """``'0.812 ± 0.010 (3 seeds)'`` of a ``summarize`` result."""
  return (f'{summary["mean"] * scale:.{digits}f} ± '
          f'{summary["std"] * scale:.{digits}f} ({summary["n"]} seeds)')


def fmt_paired(p: Mapping, digits: int = 3, scale: float = 1.0) -> str:
  """``'+0.012 ± 0.004, same sign in 3/3 seeds'`` of a ``paired`` result."""
  return (f'{p["mean"] * scale:+.{digits}f} ± {p["std"] * scale:.{digits}f}, '
          f'same sign in {p["agree"]}/{p["n"]} seeds')


def comparison_lines(comparisons: Sequence[Mapping]) -> list[str]:
  """A results .md's comparison table (accuracy points, :func:`paired`
  records with a ``label``) and the line naming the comparisons whose sign
  held in every one of at least 3 seeds."""
  lines = ['', '| comparison | accuracy difference (points) |', '|---|---|']
  lines += [f'| {c["label"]} | {fmt_paired(c, 1, 100)} |'
            for c in comparisons]
  held = [c['label'] for c in comparisons
          if c['n'] >= 3 and c['agree'] == c['n']]
  return lines + ['', 'Supported by every seed (same sign of the paired '
                  'difference in all of at least 3 seeds): '
                  + ('; '.join(held) or 'none')
                  + '. Other differences are not claimed.']


def paired_at_equal_upload(a: Mapping, b: Mapping, key: str) -> dict:
  """Row ``a`` at its last evaluation against row ``b`` at the evaluation
  whose cumulative ``upload_bytes`` is closest, per seed (a comparison at
  equal upload bytes rather than equal rounds).

  Args:
    a, b: results rows, each with ``runs`` (one per seed, with ``seed`` and
      ``curve``).
    key: the compared metric of the curves, e.g. ``'perplexity'``.

  Returns:
    :func:`paired` of the two plus ``rounds``: ``{seed: (round of a, round
    of b)}``.

  Raises:
    ValueError: a seed of ``a`` has no run in ``b`` (one line naming both
      seed lists).
  """
  va, vb, rounds = {}, {}, {}
  for run in a['runs']:
    last = run['curve'][-1]
    other = next((r['curve'] for r in b['runs'] if r['seed'] == run['seed']),
                 None)
    if other is None:
      raise ValueError(f'seed {run["seed"]} of a has no run in b; seeds of a: '
                       f'{[r["seed"] for r in a["runs"]]}, of b: '
                       f'{[r["seed"] for r in b["runs"]]}.')
    near = min(other, key=lambda e: abs(e['upload_bytes'] -
                                        last['upload_bytes']))
    va[run['seed']], vb[run['seed']] = last[key], near[key]
    rounds[run['seed']] = (last['round'], near['round'])
  return {'rounds': rounds, **paired(va, vb)}


def eval_rows(curve: Sequence[Mapping]) -> list[dict]:
  """The evaluation rows of a run's ``metrics.jsonl`` rows (either schema:
  ``round_metrics.normalize_row``), flat as the results files keep them:
  round, the test metrics (accuracy, loss, perplexity, ...) and the
  cumulative ``upload_bytes`` / ``download_bytes``."""
  out = []
  for row in map(round_metrics.normalize_row, curve):
    if round_metrics.is_evaluation(row):
      out.append({'round': row['round'], **round_metrics.eval_metrics(row),
                  **{k: row[f'comm/{k}_total']
                     for k in ('upload_bytes', 'download_bytes')
                     if f'comm/{k}_total' in row}})
  return out


def plot_seed_bands(results: Sequence[Mapping], path, *, xlabel: str,
                    title: str, scale: float = 1.0,
                    ylabel: str = 'test accuracy',
                    key: str = 'accuracy') -> None:
  """``key`` by round per row: mean over its ``runs`` (one per seed) with
  error bars of ± one sample standard deviation; y axis framed on the last
  two thirds of the curves (where the claims are). Writes a PNG."""
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  lo = hi = None
  for r in results:
    rounds = [p['round'] for p in r['runs'][0]['curve']]
    acc = scale * np.array([[p[key] for p in run['curve']]
                            for run in r['runs']])
    mean = acc.mean(0)
    std = acc.std(0, ddof=1) if len(acc) > 1 else 0 * mean
    ax.errorbar(rounds, mean, yerr=std, marker='o', ms=3, capsize=3,
                label=r['label'])
    tail = slice(len(mean) // 3, None)
    lo = min(lo if lo is not None else np.inf, float((mean - std)[tail].min()))
    hi = max(hi if hi is not None else -np.inf, float((mean + std)[tail].max()))
  pad = 0.1 * (hi - lo) if hi is not None and hi > lo else 0.01 * scale
  ax.set(xlabel=xlabel, ylabel=ylabel, title=title,
         ylim=(lo - pad, hi + pad) if lo is not None else None)
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
