"""Download/upload compression for any ``fedjax.for_each_client`` algorithm.

The algorithm runs unmodified; each call's ``shared_input`` and each client's
``client_final`` output are encoded and decoded, their bits charged to a
ledger. Notes (keys, rounds): docs/notes/engines.md.
"""

from __future__ import annotations

import collections
import itertools
import zlib
from typing import Any, Iterable, Iterator, Optional, Union

import fedjax
from fedjax.core import for_each_client as fedjax_for_each_client
import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax import transforms as tx
from fedlite_jax.comm import ledger as ledger_lib
from fedlite_jax.rounds import fedjax_backend
from fedlite_jax.common import DOWNLOAD_STREAM, PyTree, UPLOAD_STREAM


BASES = ('jit', 'vmap')

__all__ = ['BASES', 'CompressedBackend', 'DOWNLOAD_STREAM', 'UPLOAD_STREAM']


def _compressible(x: Any) -> bool:
  """Floating arrays with >= 1 dimension go through the transform."""
  dtype = jnp.result_type(x)
  return (jnp.issubdtype(dtype, jnp.floating) and not
          jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key) and
          jnp.ndim(x) >= 1)


def _raw_bits(x: Any) -> float:
  """Bits of a leaf sent as is: ``8 * itemsize`` per entry."""
  if jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  return float(tx.dtype_bits(jnp.result_type(x)) * np.size(x))


def _is_key(x: Any) -> bool:
  """A PRNG key: typed key scalar or raw ``uint32[2]``."""
  if not hasattr(x, 'dtype') or not hasattr(x, 'shape'):
    return False
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return x.shape == ()
  return x.dtype == np.uint32 and tuple(x.shape) == (2,)


def _client_hash(client_id: Any) -> int:
  """A 32-bit integer from a client id (bytes, str, int or other)."""
  if isinstance(client_id, (int, np.integer)):
    return int(client_id) % 2**32
  if isinstance(client_id, str):
    client_id = client_id.encode()
  if not isinstance(client_id, bytes):
    client_id = repr(client_id).encode()
  return zlib.crc32(client_id)


def _make_base(base: Union[None, str, fedjax.ForEachClientBackend],
               lanes_per_device: Union[int, str]
               ) -> fedjax.ForEachClientBackend:
  if base is None or base == 'jit':
    return fedjax_for_each_client.ForEachClientJitBackend()
  if base == 'vmap':
    return fedjax_backend.VmapBackend(lanes_per_device=lanes_per_device)
  if isinstance(base, fedjax.ForEachClientBackend):
    return base
  raise ValueError(f'base must be None, one of {BASES} or a '
                   f'fedjax.ForEachClientBackend; got {base!r}.')


def _as_transform(t: Union[None, str, tx.CommTransform], seed: int,
                  what: str) -> Optional[tx.CommTransform]:
  if t is None or isinstance(t, tx.CommTransform):
    return t
  if isinstance(t, str):
    return tx.parse_chain(t, seed=seed) if t else None
  raise ValueError(f'{what} must be None, a stage string or a '
                   f'transforms.CommTransform; got {t!r}.')


class _Channel:
  """One direction: a transform, its read-only states and message sizes."""

  def __init__(self, transform: Optional[tx.CommTransform], what: str):
    self.transform = transform
    self.what = what
    self._states: dict[tx.TreeSpec, tuple[Any, float]] = {}
    if transform is not None:
      def encode_decode(tree, state, key):
        message, _ = transform.encode(tree, state, key)
        return transform.decode(message, state)[0]
      self._encode_decode = jax.jit(encode_decode)

  def _state(self, tree: PyTree) -> tuple[Any, float]:
    spec = tx.TreeSpec.of(tree)
    if spec not in self._states:
      example = jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)),
          tree)
      state = tx.init_read_only(self.transform, example, self.what)
      bits = float(tx.message_bits(self.transform, example, state))
      self._states[spec] = (state, bits)
    return self._states[spec]

  def send(self, tree: PyTree, key_fn) -> tuple[PyTree, float, int]:
    """``(received tree, bits, compressed entries)`` of ``tree``."""
    leaves, treedef = jax.tree.flatten(tree)
    mask = [self.transform is not None and _compressible(x) for x in leaves]
    bits = sum(_raw_bits(x) for x, m in zip(leaves, mask) if not m)
    compressed = int(sum(np.size(x) for x, m in zip(leaves, mask) if m))
    if not any(mask):
      return tree, float(bits), compressed
    sub = jax.tree.unflatten(
        treedef, [x if m else None for x, m in zip(leaves, mask)])
    state, message_bits = self._state(sub)
    decoded = iter(jax.tree.leaves(self._encode_decode(sub, state, key_fn())))
    out = [next(decoded) if m else x for x, m in zip(leaves, mask)]
    return (jax.tree.unflatten(treedef, out), float(bits + message_bits),
            compressed)


class CompressedBackend(fedjax.ForEachClientBackend):
  """A ``fedjax.ForEachClientBackend`` that compresses download and upload.

  Select it before building the algorithm (FedJAX binds the backend then).
  Floating array leaves with >= 1 dimension go through the transform; other
  leaves pass through at ``8 * itemsize`` bits per entry. Bits per client
  per round: upload = ``Encoded.bits`` of its output plus pass-through;
  download = the call's shared input, each array once per round. Keys fold
  ``seed``, the round and the client (or a PRNG-key client input) as
  :mod:`fedlite_jax.algorithms.fedopt`. Transform state must be read-only.

  Args:
    upload: transform of each client's output: a
      :class:`~fedlite_jax.transforms.CommTransform`, a stage string
      (:func:`fedlite_jax.transforms.parse_chain`; its seed defaults to
      ``seed``), or None/'' (uncompressed).
    download: transform of each call's shared input (same forms).
    base: None or 'jit' (FedJAX's jit backend), 'vmap'
      (:class:`~fedlite_jax.rounds.VmapBackend`), or any
      ``fedjax.ForEachClientBackend``.
    seed: run seed of the download keys (and of non-key client inputs).
    num_params: D of the ledger's baseline (``32 D`` bits per client per
      direction); default: the compressible entries of the first output.
    lanes_per_device: for base 'vmap' only (``VmapBackend``).

  Raises:
    ValueError: a bad ``base`` or transform, or (when run) a non-read-only one.
  """

  def __init__(self, upload: Union[None, str, tx.CommTransform] = None,
               download: Union[None, str, tx.CommTransform] = None,
               base: Union[None, str, fedjax.ForEachClientBackend] = None,
               seed: int = 0, num_params: Optional[int] = None,
               lanes_per_device: Union[int, str] = 'auto'):
    self.upload = _as_transform(upload, seed, 'upload')
    self.download = _as_transform(download, seed, 'download')
    self._base = _make_base(base, lanes_per_device)
    self._seed = int(seed)
    self._up = _Channel(self.upload, 'the upload transform')
    self._down = _Channel(self.download, 'the download transform')
    if num_params is not None and int(num_params) < 1:
      raise ValueError(f'num_params must be >= 1; got {num_params!r}.')
    self._num_params = None if num_params is None else int(num_params)
    self._tokens = itertools.count()
    self._round = -1
    self._called: set[int] = set()
    self._call_index = 0
    self._sent: dict[int, tuple[Any, Any]] = {}
    self._bits: dict[int, dict[Any, dict[str, float]]] = {}

  @property
  def client_bits(self) -> dict[int, dict[Any, dict[str, float]]]:
    """``{round: {client_id: {'upload_bits': u, 'download_bits': d}}}``."""
    return {r: {c: dict(v) for c, v in row.items()}
            for r, row in self._bits.items()}

  @property
  def ledger(self) -> ledger_lib.CommLedger:
    """A :class:`~fedlite_jax.comm.CommLedger` of every round so far.

    Raises:
      ValueError: before any client output when ``num_params`` was not given.
    """
    if self._num_params is None:
      raise ValueError('CompressedBackend.ledger: no client has run yet, so '
                       'the model size is unknown; pass num_params=.')
    ledger = ledger_lib.CommLedger(self._num_params)
    for r in sorted(self._bits):
      ledger.record_round(r, self._bits[r])
    return ledger

  def _start_call(self, token: int) -> tuple[int, int]:
    if self._round < 0 or token in self._called:
      self._round += 1
      self._called = set()
      self._call_index = 0
      self._sent = {}
    else:
      self._call_index += 1
    self._called.add(token)
    return self._round, self._call_index

  def _download_key(self, round_num: int, call_index: int) -> jax.Array:
    key = jax.random.fold_in(
        jax.random.fold_in(jax.random.PRNGKey(self._seed), DOWNLOAD_STREAM),
        round_num)
    return jax.random.fold_in(key, call_index) if call_index else key

  def _upload_key(self, client_id: Any, client_input: Any, round_num: int,
                  call_index: int) -> jax.Array:
    if _is_key(client_input):
      key = jax.random.fold_in(client_input, UPLOAD_STREAM)
    else:
      key = jax.random.fold_in(jax.random.fold_in(
          jax.random.fold_in(jax.random.PRNGKey(self._seed), UPLOAD_STREAM),
          round_num), _client_hash(client_id))
    return jax.random.fold_in(key, call_index) if call_index else key

  def _send_shared(self, shared_input: PyTree, round_num: int,
                   call_index: int) -> tuple[PyTree, float]:
    """The shared input clients receive, and its bits (once per round)."""
    leaves, treedef = jax.tree.flatten(shared_input)
    fresh = [i for i, x in enumerate(leaves)
             if not (id(x) in self._sent and self._sent[id(x)][0] is x)]
    out = [self._sent[id(x)][1] if i not in fresh else x
           for i, x in enumerate(leaves)]
    if not fresh:
      return jax.tree.unflatten(treedef, out), 0.0
    fresh_set = set(fresh)
    sub = jax.tree.unflatten(
        treedef, [x if i in fresh_set else None for i, x in enumerate(leaves)])
    received, bits, _ = self._down.send(
        sub, lambda: self._download_key(round_num, call_index))
    for i, y in zip(fresh, jax.tree.leaves(received)):
      self._sent[id(leaves[i])] = (leaves[i], y)
      out[i] = y
    return jax.tree.unflatten(treedef, out), bits

  def _record(self, round_num: int, client_id: Any, upload_bits: float,
              download_bits: float) -> None:
    row = self._bits.setdefault(round_num, {})
    entry = row.setdefault(client_id, {'upload_bits': 0.0,
                                       'download_bits': 0.0})
    entry['upload_bits'] += upload_bits
    entry['download_bits'] += download_bits

  def __call__(self, client_init, client_step, client_final):
    inner = self._base(client_init, client_step, client_final)
    token = next(self._tokens)

    def run(shared_input: PyTree,
            clients: Iterable[tuple[Any, Iterable[Any], PyTree]]
            ) -> Iterator[tuple[Any, PyTree, list]]:
      round_num, call_index = self._start_call(token)
      received, download_bits = self._send_shared(shared_input, round_num,
                                                  call_index)
      clients = list(clients)
      keys = collections.defaultdict(collections.deque)
      for client_id, _, client_input in clients:
        keys[client_id].append(client_input)
      results = inner(received, clients)
      return self._uploads(results, keys, round_num, call_index,
                           download_bits)

    return run

  def _uploads(self, results, client_inputs, round_num: int, call_index: int,
               download_bits: float):
    for client_id, output, step_results in results:
      client_input = client_inputs[client_id].popleft()
      sent, upload_bits, compressed = self._up.send(
          output, lambda: self._upload_key(client_id, client_input, round_num,
                                           call_index))
      if self._num_params is None:
        self._num_params = compressed or int(sum(
            np.size(x) for x in jax.tree.leaves(output)
            if _compressible(x))) or None
      self._record(round_num, client_id, upload_bits, download_bits)
      yield client_id, sent, step_results
