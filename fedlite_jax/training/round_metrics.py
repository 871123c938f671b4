"""One metric schema for every output: a row per round, evaluations merged in.

``metrics.jsonl``, TensorBoard (tag = key, step = ``round``) and
``communication.csv`` share the keys and the round numbers: ``round`` is the
number of rounds completed (1 for the first round; 0 only for the
evaluation of an ``--init_checkpoint`` before training). A row holds:

* ``train/loss``: the example-weighted mean of the kept clients' training
  losses (diagnostic ``train_loss``, weights ``train_examples``, else
  ``num_examples``): each client's mean over the examples of its local
  steps, each evaluated at the parameters its step started from (split
  learning: the server-side loss of the round's batch, before the update);
  ``train/accuracy`` likewise where the algorithm reports ``train_accuracy``;
* ``train/delta_norm_mean``, ``train/delta_norm_max``: of the kept clients'
  ``delta_l2_norm`` (algorithms that send model deltas);
* ``train/clients``, ``train/skipped_clients`` (non-finite updates dropped);
* with DP-FedAvg (``--dp_clip``): ``privacy/clipped_fraction`` (kept
  clients whose decoded update was clipped, diagnostic ``dp_clipped``) and,
  from the privacy hook, ``privacy/epsilon``, ``privacy/clip_norm``,
  ``privacy/noise_std``;
* ``comm/upload_bytes``, ``comm/download_bytes`` (this round's; the sum of
  the round's ``communication.csv`` bits / 8) and ``comm/upload_bytes_total``,
  ``comm/download_bytes_total`` (running totals);
* ``time/data_seconds`` (waiting for the cohort), ``time/train_seconds``,
  ``time/eval_seconds`` (evaluation rounds only): wall-clock, they differ
  between identical runs (:func:`varies_between_runs`);
* ``engine/<count>``: every count the round engines recorded this round
  (``rounds.recording_stats``), whatever their names;
* ``eval/<metric>`` on evaluation rounds (``--eval_every``, the last round):
  the task's test metrics (``accuracy``, ``loss``, ``perplexity``, ...).

Rows written before this schema (flat ``accuracy`` and cumulative
``upload_bytes``; ``comm/total_upload_bytes``) are read into it by
:func:`normalize_row` (``outputs.read_metrics`` does so).
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Sequence

from fedlite_jax.comm.ledger import BITS_PER_BYTE
from fedlite_jax.rounds import stats as engine_stats

#: The namespace of test metrics.
EVAL = 'eval/'
#: Legacy keys and their names in this schema.
_RENAMED = {'upload_bytes': 'comm/upload_bytes_total',
            'download_bytes': 'comm/download_bytes_total',
            'comm/total_upload_bytes': 'comm/upload_bytes_total',
            'comm/total_download_bytes': 'comm/download_bytes_total'}
#: Engine recorder entries that are settings, not per-round counts.
_ENGINE_SETTINGS = ('name',) + engine_stats.SETTINGS


def _weighted_mean(pairs: Sequence[tuple[float, float]]) -> float:
  """``sum(v w) / sum(w)`` (NaN when the weights sum to 0)."""
  total = sum(w for _, w in pairs)
  return sum(v * w for v, w in pairs) / total if total > 0 else math.nan


def train_metrics(diagnostics: Mapping[Any, Mapping[str, Any]]
                  ) -> dict[str, float]:
  """``train/*`` of one round from its per-client diagnostics.

  Args:
    diagnostics: ``{client_id: {...}}`` as an algorithm's ``apply``
      returns it; clients with ``skipped`` set are left out.

  Returns:
    ``train/loss``, ``train/accuracy``, ``train/delta_norm_mean`` and
    ``train/delta_norm_max``, ``privacy/clipped_fraction``, each only if
    some kept client reports its diagnostic (``train_loss``,
    ``train_accuracy``, ``delta_l2_norm``, ``dp_clipped``).
  """
  kept = [d for d in diagnostics.values() if not d.get('skipped', False)]
  out = {}
  for key, name in (('train_loss', 'train/loss'),
                    ('train_accuracy', 'train/accuracy')):
    pairs = [(float(d[key]), float(d.get('train_examples',
                                         d.get('num_examples', 1.0))))
             for d in kept if key in d]
    if pairs:
      out[name] = _weighted_mean(pairs)
  norms = [float(d['delta_l2_norm']) for d in kept if 'delta_l2_norm' in d]
  if norms:
    out['train/delta_norm_mean'] = sum(norms) / len(norms)
    out['train/delta_norm_max'] = max(norms)
  clipped = [float(d['dp_clipped']) for d in kept if 'dp_clipped' in d]
  if clipped:
    out['privacy/clipped_fraction'] = sum(clipped) / len(clipped)
  return out


def comm_metrics(round_totals: Mapping[str, Any],
                 summary: Mapping[str, Any]) -> dict[str, float]:
  """``train/clients``, ``train/skipped_clients`` and ``comm/*`` of a round.

  Args:
    round_totals: ``CommLedger.record_round``'s return (bits, clients).
    summary: ``CommLedger.summary()`` after the round (bytes so far).
  """
  return {'train/clients': int(round_totals['num_clients']),
          'train/skipped_clients': int(round_totals['skipped_clients']),
          'comm/upload_bytes': round_totals['upload_bits'] / BITS_PER_BYTE,
          'comm/download_bytes': (round_totals['download_bits'] /
                                  BITS_PER_BYTE),
          'comm/upload_bytes_total': summary['total_upload_bytes'],
          'comm/download_bytes_total': summary['total_download_bytes']}


def engine_metrics(counts: Mapping[str, Any]) -> dict[str, float]:
  """``engine/<key>`` for every numeric count of ``recorder.take()`` (the
  engine's ``name`` and ``stats.SETTINGS`` are settings, left out)."""
  return {f'engine/{k}': v for k, v in counts.items()
          if k not in _ENGINE_SETTINGS and isinstance(v, numbers.Real)
          and not isinstance(v, bool)}


def engine_totals(rows: Sequence[Mapping[str, Any]]) -> dict[str, float]:
  """``{count: total over rows}`` of the rows' ``engine/<count>`` entries:
  sums, the largest value for ``stats.MAXIMA`` (the longest client)."""
  out: dict[str, float] = {}
  for row in rows:
    for k, v in row.items():
      if k.startswith('engine/'):
        name = k[len('engine/'):]
        if name in engine_stats.MAXIMA:
          out[name] = max(out.get(name, v), v)
        else:
          out[name] = out.get(name, 0) + v
  return out


def varies_between_runs(key: str) -> bool:
  """Whether a row key's value depends on the process's history rather
  than on the flags: wall-clock times (``time/``) and compile counts and
  seconds (``engine/`` keys naming ``compil``, e.g.
  ``engine/client_program_compilations``: a resumed process compiles
  again)."""
  return key.startswith('time/') or (key.startswith('engine/') and
                                     'compil' in key)


def normalize_row(row: Mapping[str, Any]) -> dict[str, Any]:
  """``row`` in this schema: legacy flat metrics become ``eval/<name>``,
  legacy byte totals ``comm/*_bytes_total``; current rows are unchanged."""
  out = {}
  for k, v in row.items():
    if k in _RENAMED:
      k = _RENAMED[k]
    elif '/' not in k and k != 'round':
      k = EVAL + k
    out.setdefault(k, v)
  return out


def eval_row(metrics: Mapping[str, Any]) -> dict[str, Any]:
  """Test metrics ``{name: value}`` as row keys ``eval/<name>``."""
  return {EVAL + k: v for k, v in metrics.items()}


def is_evaluation(row: Mapping[str, Any]) -> bool:
  """Whether ``row`` (this schema) holds an evaluation (an ``eval/`` key)."""
  return any(k.startswith(EVAL) for k in row)


def evaluations(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
  """The evaluation rows of ``rows`` (:func:`is_evaluation`), in order."""
  return [dict(r) for r in rows if is_evaluation(r)]


def eval_metrics(row: Mapping[str, Any]) -> dict[str, Any]:
  """The test metrics of an evaluation row, by bare name (``accuracy``)."""
  return {k[len(EVAL):]: v for k, v in row.items() if k.startswith(EVAL)}


def hparams(fingerprint: Mapping[str, Any],
            **extra: Any) -> dict[str, bool | int | float | str]:
  """A run's settings as TensorBoard hparams: ``fingerprint``'s fields,
  its ``options`` by their flag names, and ``extra``; values other than
  bool, int, float and str become their ``str``."""
  flat = {k: v for k, v in fingerprint.items() if k != 'options'}
  flat.update(fingerprint.get('options', {}))
  flat.update(extra)
  return {k: v if isinstance(v, (bool, int, float, str)) else str(v)
          for k, v in sorted(flat.items())}
