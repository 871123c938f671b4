"""Local batches for a client update, deterministic per (seed, round, client).

FedJAX's ``ClientDataset.shuffle_repeat_batch`` produces the batches (so ours
are exactly FedJAX's); every batch it yields is full (it wraps into the next
repetition), so all clients' batches share one shape and compile once.
"""

from __future__ import annotations

import zlib

import fedjax
import jax
import numpy as np

from fedlite_jax.rounds import remote


def shuffle_seed_from_rng(rng: jax.Array) -> int:
  """A 31-bit NumPy shuffle seed derived deterministically from a PRNG key.

  FedJAX's default ``ShuffleRepeatBatchHParams.seed=None`` shuffles
  nondeterministically; deriving the seed from the client's key (itself
  derived from the run seed, round and client) keeps runs reproducible.
  """
  data = np.asarray(jax.random.key_data(rng) if jax.dtypes.issubdtype(
      rng.dtype, jax.dtypes.prng_key) else rng)
  return zlib.crc32(data.tobytes()) & 0x7FFFFFFF


def client_batches(dataset: fedjax.ClientDataset,
                   hparams: fedjax.ShuffleRepeatBatchHParams,
                   rng: jax.Array) -> list[dict[str, np.ndarray]]:
  """The client's local batches for one round.

  Args:
    dataset: the client's data.
    hparams: FedJAX batching hyper-parameters (batch size, epochs, optional
      step cap). If ``hparams.seed`` is None the shuffle seed is derived from
      ``rng``; otherwise ``hparams.seed`` is used as is (FedJAX's behaviour:
      the same order every round).
    rng: the client's PRNG key for this round.

  Returns:
    A list of batches (dicts of NumPy arrays, each of ``batch_size`` rows);
    for a :class:`~fedlite_jax.rounds.remote.RemoteClientDataset` (a client
    another process runs) a ``RemoteBatches`` of the same length.

  Raises:
    ValueError: if the client has no examples.
  """
  if isinstance(dataset, remote.RemoteClientDataset):
    # Another process runs this client (multi-host): only the count matters.
    return dataset.shuffle_repeat_batch(hparams)
  if len(dataset) == 0:
    raise ValueError('Cannot batch a client with 0 examples.')
  if hparams.seed is None:
    hparams = fedjax.ShuffleRepeatBatchHParams(
        batch_size=hparams.batch_size,
        num_epochs=hparams.num_epochs,
        num_steps=hparams.num_steps,
        drop_remainder=hparams.drop_remainder,
        seed=shuffle_seed_from_rng(rng),
        skip_shuffle=hparams.skip_shuffle)
  return list(dataset.shuffle_repeat_batch(hparams))
