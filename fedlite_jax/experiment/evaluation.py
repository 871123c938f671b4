"""Test-set evaluation over (a fixed sample of) the test clients."""

from __future__ import annotations

import math
from typing import Any, Optional

import fedjax
import numpy as np


def eval_batches(test_fd: fedjax.FederatedData, batch_size: int,
                 num_clients: Optional[int], seed: int) -> list[dict]:
  """Padded batches over the pooled examples of the test clients.

  Pools the examples of all test clients (or ``num_clients`` of them, chosen
  once with ``seed``) with ``fedjax.padded_batch_client_datasets``, so all
  batches but the last are full and share one compiled shape. Computed once
  per run and reused at every evaluation.

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
  return list(fedjax.padded_batch_client_datasets(datasets,
                                                  batch_size=batch_size))


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
