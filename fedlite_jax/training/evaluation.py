"""Test-set evaluation, and the check that a final evaluation is a trained
model (finite, better than chance) rather than a result to report.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping, Optional

import fedjax
from fedjax.core import models as fedjax_models
import jax
import numpy as np


def eval_batches(test_fd: fedjax.FederatedData, batch_size: int,
                 num_clients: Optional[int], seed: int) -> list[dict]:
  """Padded batches (on the device; the last one masked) of the pooled
  examples of ``num_clients`` test clients chosen with ``seed`` (0/None:
  all); ValueError if there are none."""
  ids = list(test_fd.client_ids())
  if not ids:
    raise ValueError('The test split has no clients.')
  if num_clients and num_clients < len(ids):
    rng = np.random.RandomState(seed)
    ids = [ids[i] for i in sorted(rng.choice(len(ids), num_clients,
                                             replace=False))]
  datasets = [cds for _, cds in test_fd.get_clients(ids)]
  return jax.device_put(list(fedjax.padded_batch_client_datasets(
      datasets, batch_size=batch_size)))


@functools.partial(jax.jit, static_argnums=0)
def _zero_stats(model: fedjax.Model) -> dict[str, Any]:
  return {k: metric.zero() for k, metric in model.eval_metrics.items()}


@jax.jit
def _results(stats: dict[str, Any]) -> dict[str, jax.Array]:
  return jax.tree.map(lambda s: s.result(), stats, is_leaf=lambda v: isinstance(
      v, fedjax.metrics.Stat))


def evaluate(model: fedjax.Model, params: Any,
             batches: list[dict]) -> dict[str, float]:
  """``fedjax.evaluate_model`` as floats, plus ``perplexity = exp(loss)``
  for sequence models (integer 2-D ``'y'``).

  The same computation as FedJAX's (its jitted per-batch step), with the
  zero statistics and the results in compiled programs too: no eager
  operations.
  """
  stats = _zero_stats(model)
  for batch in batches:
    stats = fedjax_models._evaluate_model_step(  # pylint: disable=protected-access
        model, params, batch, stats)
  metrics = {k: float(v) for k, v in _results(stats).items()}
  if batches and np.ndim(batches[0]['y']) == 2 and 'loss' in metrics and \
      np.issubdtype(np.asarray(batches[0]['y']).dtype, np.integer):
    metrics['perplexity'] = float(math.exp(min(metrics['loss'], 700.0)))
  return metrics


#: Absolute slack (nats) over the chance loss: a softmax model fails when it
#: gives the true label under 1/e of the uniform probability (geometric
#: mean), e.g. loss > 3.303 for 10 classes, perplexity > e x vocabulary.
CHANCE_MARGIN_NATS = 1.0
#: Relative slack: the margin is at least this fraction of the chance loss
#: (matters above 10 nats, e.g. 1,000 tags: chance 693.1, limit 762.5).
CHANCE_MARGIN_RELATIVE = 0.1
#: Metrics that must be finite in a final evaluation (when present).
HEADLINE_METRICS = ('loss', 'perplexity', 'accuracy')


class TrainingFailedError(FloatingPointError):
  """The trained model's evaluation is non-finite or worse than chance
  (a FloatingPointError, so the binary reports it in one line)."""


def chance_loss(num_classes: int, multilabel: bool = False) -> float:
  """The test loss (nats) of an uninformed predictor.

  Args:
    num_classes: output classes C (language models: the whole vocabulary).
    multilabel: the loss sums C per-class sigmoid cross-entropies.

  Returns:
    ``log(C)`` (uniform prediction), or ``C * log(2)`` for multi-label.

  Raises:
    ValueError: if ``num_classes < 2``.
  """
  if num_classes < 2:
    raise ValueError(f'num_classes={num_classes}: need at least 2 classes.')
  return num_classes * math.log(2.0) if multilabel else math.log(num_classes)


def chance_limit(chance: float) -> float:
  """The largest passing test loss (nats): ``chance + max(CHANCE_MARGIN_NATS,
  CHANCE_MARGIN_RELATIVE * chance)``; ValueError if ``chance <= 0``."""
  if not chance > 0:
    raise ValueError(f'chance={chance}: the chance loss must be > 0.')
  return chance + max(CHANCE_MARGIN_NATS, CHANCE_MARGIN_RELATIVE * chance)


def training_failure(metrics: Mapping[str, Any],
                     chance: float) -> Optional[str]:
  """Why a final evaluation is not a trained model, or None if it is.

  It fails if one of :data:`HEADLINE_METRICS` is not finite, or its loss
  (for language models ``log(perplexity)``, the per-token loss) exceeds
  :func:`chance_limit`.

  Args:
    metrics: the evaluation; floats, or strings such as 'nan' as read back
      from metrics.jsonl.
    chance: the chance loss in nats (:func:`chance_loss`), > 0.

  Returns:
    A one-line reason naming the metric, its value and the limit, or None.

  Raises:
    ValueError: ``chance <= 0``, or neither 'loss' nor 'perplexity' given.
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


def mean_noise_std(privacy: Mapping[str, Any]) -> float:
  """Std of the DP noise per coordinate of the mean update (units of the
  parameters), ``z_Delta * C / M`` (McMahan et al. 2018, Alg. 1), from
  summary.json's ``privacy`` (``delta_noise_multiplier``,
  ``final_clip_norm`` else ``clip_norm``, ``noise_cohort_size``)."""
  clip = privacy.get('final_clip_norm', privacy.get('clip_norm'))
  return (float(privacy['delta_noise_multiplier']) * float(clip) /
          float(privacy['noise_cohort_size']))


def _dp_advice(privacy: Mapping[str, Any]) -> str:
  """Why a DP run may fail: the noise on the mean, and its levers."""
  clip = privacy.get('final_clip_norm', privacy.get('clip_norm'))
  return (f'DP: eps={privacy["epsilon"]:.4g} at delta={privacy["delta"]:g};'
          f' the noise std per coordinate of the mean update is z*C/M = '
          f'{privacy["delta_noise_multiplier"]:.4g}*{clip:.4g}/'
          f'{privacy["noise_cohort_size"]:g} = {mean_noise_std(privacy):.3g} '
          'each round; lower it with a larger cohort (--clients_per_round'
          + ('' if privacy.get('mechanism') in ('ddgauss', 'skellam') else
             ', or --dp_noise_cohort_size for the noise of a production '
             'cohort') + '), a lower --server_lr, or a lower '
          '--dp_noise_multiplier (a larger epsilon)')


def check_trained(metrics: Mapping[str, Any], chance: float,
                  output_dir: Optional[str] = None,
                  privacy: Optional[Mapping[str, Any]] = None) -> None:
  """Raises TrainingFailedError if :func:`training_failure` finds a reason
  (one line, naming ``output_dir`` and the usual fixes; for a DP run, with
  ``privacy`` as summary.json holds it, the noise on the mean and its
  levers)."""
  reason = training_failure(metrics, chance)
  if reason is None:
    return
  kept = (f'; its outputs are in {output_dir} (summary.json: status '
          '"failed")' if output_dir is not None else '')
  advice = ('Lower --client_lr / --server_lr or set --client_clip_norm'
            if privacy is None else _dp_advice(privacy))
  raise TrainingFailedError(f'Training failed: {reason}. {advice}{kept}.')
