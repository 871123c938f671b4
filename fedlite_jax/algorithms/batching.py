"""Local batches for a client update, deterministic per (seed, round, client).

FedJAX's ``ClientDataset.shuffle_repeat_batch``: every batch is full, so all
clients' batches share one shape.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Optional, Sequence
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


def shuffle_seeds(rngs: list[jax.Array]) -> list[int]:
  """:func:`shuffle_seed_from_rng` of every key, with the keys brought to
  the host in one transfer (not one per key).

  Args:
    rngs: the clients' PRNG keys (``uint32[2]`` or typed keys).

  Returns:
    One 31-bit NumPy shuffle seed (``int`` in ``[0, 2**31)``) per key.
  """
  data = jax.device_get([
      jax.random.key_data(r) if jax.dtypes.issubdtype(
          r.dtype, jax.dtypes.prng_key) else r for r in rngs])
  return [zlib.crc32(np.asarray(d).tobytes()) & 0x7FFFFFFF for d in data]


def client_batches(dataset: fedjax.ClientDataset,
                   hparams: fedjax.ShuffleRepeatBatchHParams,
                   rng: jax.Array, seed: int | None = None
                   ) -> Sequence[dict[str, np.ndarray]]:
  """The client's local batches for one round.

  Args:
    dataset: the client's data.
    hparams: FedJAX batching; ``seed=None``: derived from ``rng``.
    rng: the client's PRNG key for this round.
    seed: ``shuffle_seed_from_rng(rng)`` when already known (see
      :func:`shuffle_seeds`); used only when ``hparams.seed`` is None.

  Returns:
    A sequence of batches (dicts of NumPy arrays of ``batch_size`` rows):
    :class:`ClientBatches` for a ``fedjax.ClientDataset`` that ends (made
    on first access), ``RemoteBatches`` for a
    ``RemoteClientDataset`` (another process's client), else a list.

  Raises:
    ValueError: if the client has no examples.
  """
  if isinstance(dataset, remote.RemoteClientDataset):
    # Another process runs this client (multi-host): only the count matters.
    return dataset.shuffle_repeat_batch(hparams)
  if len(dataset) == 0:
    raise ValueError('Cannot batch a client with 0 examples.')
  if hparams.seed is None:
    hparams = dataclasses.replace(
        hparams, seed=shuffle_seed_from_rng(rng) if seed is None else seed)
  if not isinstance(dataset, fedjax.ClientDataset) or (
      hparams.num_epochs is None and hparams.num_steps is None):
    return list(dataset.shuffle_repeat_batch(hparams))
  return ClientBatches(dataset, hparams)


class ClientBatches(Sequence[dict]):
  """A client's batches for one round, made on first access.

  Order: FedJAX's ``shuffle_repeat_batch`` (:func:`batch_indices`).
  ``len()`` is FedJAX's batch count (``remote.num_shuffle_repeat_batches``);
  item ``i`` is a dict of NumPy arrays of ``batch_size`` rows (views into
  the client's preprocessed rows), as FedJAX's ``i``-th batch; slices give
  lists. Raises ``IndexError`` past the end, like a list.
  """

  def __init__(self, dataset: fedjax.ClientDataset,
               hparams: fedjax.ShuffleRepeatBatchHParams):
    self._dataset, self._hparams = dataset, hparams
    self._len = remote.num_shuffle_repeat_batches(len(dataset), hparams)
    self._batches: Optional[list[dict]] = None
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, index):
    if self._batches is None:
      self.make()
    return self._batches[index]

  def make(self) -> None:
    """Makes the batches now, once (thread-safe); an error leaves them
    unmade, to be raised again by the next access."""
    with self._lock:
      if self._batches is None:
        self._batches = self._make()
        self._dataset = None  # Only the batches are needed from now on.

  def _make(self) -> list[dict]:
    """The batches, preprocessed in one call (per batch if that changes the
    number of rows)."""
    idx = batch_indices(len(self._dataset), self._hparams)
    steps, b = idx.shape
    rows = {k: v[idx.ravel()] for k, v in self._dataset.raw_examples.items()}
    out = self._dataset.preprocessor(rows) if steps else {}
    if all(len(v) == steps * b for v in out.values()):
      out = {k: v.reshape((steps, b) + v.shape[1:]) for k, v in out.items()}
      return [{k: v[s] for k, v in out.items()} for s in range(steps)]
    return [self._dataset.preprocessor({k: v[s * b:(s + 1) * b]
                                        for k, v in rows.items()})
            for s in range(steps)]


_THREAD = threading.local()


def _random_state(seed: Optional[int]) -> np.random.RandomState:
  """``RandomState(seed)``'s stream: this thread's RandomState, reseeded."""
  state = getattr(_THREAD, 'random_state', None)
  if state is None:
    state = _THREAD.random_state = np.random.RandomState()
  state.seed(seed)
  return state


def batch_indices(num_examples: int,
                  hparams: fedjax.ShuffleRepeatBatchHParams) -> np.ndarray:
  """``int32[steps, batch_size]``: the example indices of each batch of
  FedJAX 0.0.17's ``ClientDataset.shuffle_repeat_batch(hparams)``, in its
  order (a ``RandomState(seed)`` shuffles one buffer in place per epoch,
  batches run across epoch ends).

  Returns:
    ``int32[steps, batch_size]`` indices into the client's examples.

  Raises:
    ValueError: both ``num_epochs`` and ``num_steps`` are None (infinite).
  """
  steps = remote.num_shuffle_repeat_batches(num_examples, hparams)
  total = steps * hparams.batch_size
  rng = _random_state(hparams.seed)
  buf = np.arange(num_examples, dtype=np.int32)
  epochs = [np.zeros((0,), np.int32)]
  for _ in range(-(-total // num_examples)):
    if not hparams.skip_shuffle:
      rng.shuffle(buf)
    epochs.append(buf.copy())
  return np.concatenate(epochs)[:total].reshape(steps, hparams.batch_size)
