"""Test-set evaluation over (a fixed sample of) the test clients.

Also the last line of defence against garbage results: a run whose final
evaluation is non-finite or worse than chance has failed
(:func:`training_failure`, :func:`check_trained`), and the runner says so
instead of reporting it as a result.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import fedjax
import jax
import numpy as np


def eval_batches(test_fd: fedjax.FederatedData, batch_size: int,
                 num_clients: Optional[int], seed: int) -> list[dict]:
  """Padded batches over the pooled examples of the test clients.

  Pools the examples of all test clients (or ``num_clients`` of them, chosen
  once with ``seed``) with ``fedjax.padded_batch_client_datasets`` (every
  batch ``batch_size`` rows, the last one masked), so one compiled program
  serves them all. Computed and put on the device once per run, reused at
  every evaluation (``fedjax.evaluate_model`` accumulates the metrics on
  the device, one jitted call per batch).

  Raises:
    ValueError: if the test split has no clients.
  """
  ids = list(test_fd.client_ids())
  if not ids:
    raise ValueError('The test split has no clients.')
  if num_clients and num_clients < len(ids):
    rng = np.random.RandomState(seed)
    ids = [ids[i] for i in sorted(rng.choice(len(ids), num_clients,
                                             replace=False))]
  datasets = [cds for _, cds in test_fd.get_clients(ids)]
  # On the device once per run: every evaluation reuses the same arrays.
  return jax.device_put(list(fedjax.padded_batch_client_datasets(
      datasets, batch_size=batch_size)))


def evaluate(model: fedjax.Model, params: Any,
             batches: list[dict]) -> dict[str, float]:
  """``fedjax.evaluate_model`` plus perplexity for language models.

  Returns:
    The model's eval metrics as floats; if the model reports a per-token
    'loss' and is a sequence model (``'perplexity'`` requested via a
    ``sequence_loss`` or a 2-D 'y'), ``perplexity = exp(loss)`` is added.
  """
  metrics = {k: float(v) for k, v in
             fedjax.evaluate_model(model, params, batches).items()}
  if batches and np.ndim(batches[0]['y']) == 2 and 'loss' in metrics and \
      np.issubdtype(np.asarray(batches[0]['y']).dtype, np.integer):
    metrics['perplexity'] = float(math.exp(min(metrics['loss'], 700.0)))
  return metrics


CHANCE_MARGIN_NATS = 1.0
"""Absolute slack (nats) over the chance loss before a model counts as worse.

A model fails when its test loss exceeds ``chance + max(CHANCE_MARGIN_NATS,
CHANCE_MARGIN_RELATIVE * chance)``: for softmax tasks, when on average
(geometrically) it gives the true label less than 1/e of the uniform
probability. Limits: 3.303 nats for 10 classes (chance 2.303), 5.127 for
FEMNIST's 62 (chance 4.127), and for a 10,004-word language model a
perplexity above e * 10,004 = 27,194.

Why this much slack: a freshly initialised model sits within 1.6% of chance
(test loss 2.314-2.339 for the 10-class CNN, 4.116-4.136 for the 62-class CNN
over three seeds), but a legitimate run of a few local steps on one
label-skewed client, evaluated on 3 other clients, reached 2.443 (6% above
log 10), so a small margin would fail short test runs. Diverged models are
far beyond it: perplexity 1e300, loss 1e9 to 1e10, or on Shakespeare with
unclipped client SGD 10^-0.5 a perplexity of 1.5e5 (loss 11.9 vs limit
10.21) within 15 rounds.
"""

CHANCE_MARGIN_RELATIVE = 0.1
"""Relative slack: the margin is at least this fraction of the chance loss.

It matters only when the chance loss exceeds 10 nats, i.e. for multi-label
losses that sum over many classes (1,000 StackOverflow tags: chance 693.1,
limit 762.5), whose fresh-model excess grows with the number of classes.
"""

HEADLINE_METRICS = ('loss', 'perplexity', 'accuracy')
"""Metrics that must be finite in a final evaluation (when present)."""


class TrainingFailedError(FloatingPointError):
  """The trained model's evaluation is non-finite or worse than chance.

  A FloatingPointError like a non-finite client update, so
  ``experiments/run_experiment.py`` reports it in one line and exits 2.
  """


def chance_loss(num_classes: int, multilabel: bool = False) -> float:
  """The test loss (nats) of an uninformed predictor.

  Args:
    num_classes: output classes C (for language models the whole output
      vocabulary, words plus special tokens: ``DatasetInfo.num_classes``).
    multilabel: True for independent per-class sigmoids whose per-example
      loss sums the C binary cross-entropies (the StackOverflow tag model's
      ``loss_reduction='sum'``).

  Returns:
    ``log(C)`` (cross-entropy of the uniform distribution; perplexity C), or
    ``C * log(2)`` for multi-label (every logit 0, probability 1/2).

  Raises:
    ValueError: if ``num_classes < 2``.
  """
  if num_classes < 2:
    raise ValueError(f'num_classes={num_classes}: need at least 2 classes.')
  return num_classes * math.log(2.0) if multilabel else math.log(num_classes)


def chance_limit(chance: float) -> float:
  """The largest passing test loss (nats) for a chance loss ``chance``.

  ``chance + max(CHANCE_MARGIN_NATS, CHANCE_MARGIN_RELATIVE * chance)``; see
  :data:`CHANCE_MARGIN_NATS`.

  Raises:
    ValueError: if ``chance <= 0``.
  """
  if not chance > 0:
    raise ValueError(f'chance={chance}: the chance loss must be > 0.')
  return chance + max(CHANCE_MARGIN_NATS, CHANCE_MARGIN_RELATIVE * chance)


def training_failure(metrics: Mapping[str, Any],
                     chance: float) -> Optional[str]:
  """Why a final evaluation is not a trained model, or None if it is.

  Rule: the evaluation fails if any of :data:`HEADLINE_METRICS` it holds is
  not finite, or if its loss exceeds :func:`chance_limit` (the chance loss
  plus a margin, :data:`CHANCE_MARGIN_NATS`). For language models (a
  'perplexity' metric) the loss compared is ``log(perplexity)``, the
  per-token cross-entropy, so the rule reads "perplexity above
  ``exp(chance_limit(chance))``" (e x the output vocabulary) whatever the
  training-loss reduction (``--lm_loss_reduction``).

  Args:
    metrics: the evaluation, e.g. ``summary['final_eval']``; values are
      floats, or strings such as 'nan' / 'inf' as read back from
      metrics.jsonl.
    chance: the chance loss in nats (:func:`chance_loss`), > 0.

  Returns:
    A one-line reason naming the metric, its value and the limit; None for
    a model that passes.

  Raises:
    ValueError: if ``chance <= 0`` or the metrics hold neither 'loss' nor
      'perplexity'.
  """
  limit = chance_limit(chance)
  values = {k: float(metrics[k]) for k in HEADLINE_METRICS if k in metrics}
  if 'loss' not in values and 'perplexity' not in values:
    raise ValueError(f'metrics hold neither loss nor perplexity: '
                     f'{sorted(metrics)}.')
  bad = [f'{k} {v}' for k, v in values.items() if not math.isfinite(v)]
  if bad:
    return f'non-finite test {", ".join(bad)}: the model diverged'
  if 'perplexity' in values:
    ppl = values['perplexity']
    if ppl > 0 and math.log(ppl) > limit:
      return (f'test perplexity {ppl:.4g} is worse than chance (uniform over '
              f'the outputs: {math.exp(chance):.6g}; limit '
              f'{math.exp(limit):.6g})')
    return None
  if values['loss'] > limit:
    return (f'test loss {values["loss"]:.6g} is worse than chance '
            f'({chance:.6g} nats; limit {limit:.6g})')
  return None


def check_trained(metrics: Mapping[str, Any], chance: float,
                  output_dir: Optional[str] = None) -> None:
  """Raises if ``metrics`` is not the evaluation of a trained model.

  See :func:`training_failure` for the rule.

  Args:
    metrics: the final evaluation.
    chance: the chance loss in nats (:func:`chance_loss`).
    output_dir: where the failed run's outputs are (named in the message).

  Raises:
    TrainingFailedError: one line naming the metric, its value and the
      threshold, with the usual fixes.
  """
  reason = training_failure(metrics, chance)
  if reason is None:
    return
  kept = (f'; its outputs are in {output_dir} (summary.json: status '
          '"failed")' if output_dir is not None else '')
  raise TrainingFailedError(
      f'Training failed: {reason}. Lower --client_lr / --server_lr or set '
      f'--client_clip_norm{kept}.')
