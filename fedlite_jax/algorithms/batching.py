"""Local batches for a client update, deterministic per (seed, round, client).

FedJAX's ``ClientDataset.shuffle_repeat_batch``: every batch is full, so all
clients' batches share one shape.
"""

from __future__ import annotations

import dataclasses
import zlib

import fedjax
import jax
import numpy as np

from fedlite_jax.rounds import remote


def shuffle_seed_from_rng(rng: jax.Array) -> int:
  """A 31-bit NumPy shuffle seed derived deterministically from a PRNG key."""
  data = np.asarray(jax.random.key_data(rng) if jax.dtypes.issubdtype(
      rng.dtype, jax.dtypes.prng_key) else rng)
  return zlib.crc32(data.tobytes()) & 0x7FFFFFFF


def client_batches(dataset: fedjax.ClientDataset,
                   hparams: fedjax.ShuffleRepeatBatchHParams,
                   rng: jax.Array) -> list[dict[str, np.ndarray]]:
  """The client's local batches for one round.

  Args:
    dataset: the client's data.
    hparams: FedJAX batching; ``seed=None``: derived from ``rng``.
    rng: the client's PRNG key for this round.

  Returns:
    A list of batches (dicts of NumPy arrays of ``batch_size`` rows); for a
    ``RemoteClientDataset`` (another process's client) ``RemoteBatches``.

  Raises:
    ValueError: if the client has no examples.
  """
  if isinstance(dataset, remote.RemoteClientDataset):
    # Another process runs this client (multi-host): only the count matters.
    return dataset.shuffle_repeat_batch(hparams)
  if len(dataset) == 0:
    raise ValueError('Cannot batch a client with 0 examples.')
  if hparams.seed is None:
    hparams = dataclasses.replace(hparams, seed=shuffle_seed_from_rng(rng))
  return list(dataset.shuffle_repeat_batch(hparams))
