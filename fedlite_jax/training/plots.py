"""Figures of runs: ``curves.png`` of one run."""

from __future__ import annotations

import os
import pathlib
from typing import Iterable, Optional

from fedlite_jax.training import config as config_lib


def run_title(config: config_lib.RunConfig) -> str:
  """``task / algorithm (seed s)`` and the compression stages, if any."""
  stages = [f'{d} {config.options.get(d)}' for d in ('upload', 'download')
            if config.options.get(d)]
  return (f'{config.task} / {config.algorithm} (seed {config.seed})' +
          (f'\n{"; ".join(stages)}' if stages else ''))


def plot_curves(output_dir: str | os.PathLike, rows: Iterable[dict],
                metric: str, title: str) -> Optional[pathlib.Path]:
  """Training loss per round beside test ``metric`` vs round and vs
  cumulative upload bytes (PNG); None without rows."""
  rows = list(rows)
  key = f'eval/{metric}'
  evals = [r for r in rows if key in r]
  train = [r for r in rows if 'train/loss' in r]
  if not evals and not train:
    return None
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (ax0, ax1, ax2) = plt.subplots(1, 3, figsize=(14, 4))
  ax0.plot([r['round'] for r in train], [r['train/loss'] for r in train],
           lw=1)
  ax0.set_xlabel('round')
  ax0.set_ylabel('training loss (clients, local steps)')
  ax1.plot([r['round'] for r in evals], [r[key] for r in evals],
           marker='.')
  ax1.set_xlabel('round')
  ax1.set_ylabel(f'test {metric}')
  sent = [r for r in evals if r['comm/upload_bytes_total'] > 0]  # log axis: no round 0
  ax2.plot([r['comm/upload_bytes_total'] for r in sent], [r[key] for r in sent],
           marker='.')
  if sent:
    ax2.set_xscale('log')
  ax2.set_xlabel('cumulative upload (bytes)')
  ax2.set_ylabel(f'test {metric}')
  for ax in (ax0, ax1, ax2):
    ax.grid(alpha=0.3)
  fig.suptitle(title)
  fig.tight_layout()
  path = pathlib.Path(output_dir) / 'curves.png'
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
