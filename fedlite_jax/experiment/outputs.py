"""Run outputs: metrics.jsonl, summary.json, TensorBoard events, PNG plot.

Files in ``output_dir``:
  metrics.jsonl      one JSON object per evaluation: round, the test metrics
                     (loss, accuracy or perplexity, ...), cumulative
                     upload/download bytes, seconds per round.
  communication.csv  one row per client per round (the ledger's rows).
  summary.json       final metrics, communication totals and ratios, rounds,
                     seconds per round, and every flag.
  tb/                TensorBoard event files (tensorboardX, no TensorFlow).
  curves.png         test metric vs round and vs cumulative upload bytes.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Any, Iterable, Optional


def _jsonable(x: Any) -> Any:
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)
  if isinstance(x, dict):
    return {k: _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  return x


def read_metrics(path: str | os.PathLike) -> list[dict]:
  """Reads metrics.jsonl (missing file -> [])."""
  path = pathlib.Path(path)
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line]


def truncate_metrics(path: str | os.PathLike, max_round: int) -> list[dict]:
  """Keeps the rows with ``round <= max_round`` (used when resuming)."""
  rows = [r for r in read_metrics(path) if r['round'] <= max_round]
  pathlib.Path(path).write_text(''.join(json.dumps(r) + '\n' for r in rows))
  return rows


def truncate_csv(path: str | os.PathLike, num_rounds: int) -> None:
  """Keeps the header and the rows of rounds < ``num_rounds``."""
  path = pathlib.Path(path)
  if not path.exists():
    return
  lines = path.read_text().splitlines(keepends=True)
  kept = lines[:1] + [l for l in lines[1:] if int(l.split(',', 1)[0]) < num_rounds]
  path.write_text(''.join(kept))


class MetricsWriter:
  """Appends evaluations to metrics.jsonl and TensorBoard."""

  def __init__(self, output_dir: str | os.PathLike):
    self.dir = pathlib.Path(output_dir)
    self.dir.mkdir(parents=True, exist_ok=True)
    self.path = self.dir / 'metrics.jsonl'
    self._tb = None

  def _writer(self):
    if self._tb is None:
      from tensorboardX import SummaryWriter  # pylint: disable=g-import-not-at-top
      self._tb = SummaryWriter(str(self.dir / 'tb'))
    return self._tb

  def write(self, row: dict[str, Any]) -> None:
    with self.path.open('a') as f:
      f.write(json.dumps(_jsonable(row)) + '\n')
    tb = self._writer()
    for k, v in row.items():
      if k != 'round' and isinstance(v, (int, float)) and math.isfinite(v):
        tb.add_scalar(k, v, row['round'])
    tb.flush()

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
      self._tb = None


def write_summary(output_dir: str | os.PathLike, summary: dict) -> pathlib.Path:
  path = pathlib.Path(output_dir) / 'summary.json'
  path.write_text(json.dumps(_jsonable(summary), indent=2, sort_keys=True))
  return path


def plot_curves(output_dir: str | os.PathLike, rows: Iterable[dict],
                metric: str, title: str) -> Optional[pathlib.Path]:
  """Test ``metric`` vs round and vs cumulative upload bytes (PNG)."""
  rows = [r for r in rows if metric in r]
  if not rows:
    return None
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
  rounds = [r['round'] for r in rows]
  values = [r[metric] for r in rows]
  ax1.plot(rounds, values, marker='.')
  ax1.set_xlabel('round')
  ax1.set_ylabel(f'test {metric}')
  ax2.plot([r['upload_bytes'] for r in rows], values, marker='.')
  ax2.set_xscale('log')
  ax2.set_xlabel('cumulative upload (bytes)')
  ax2.set_ylabel(f'test {metric}')
  for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
  fig.suptitle(title)
  fig.tight_layout()
  path = pathlib.Path(output_dir) / 'curves.png'
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
