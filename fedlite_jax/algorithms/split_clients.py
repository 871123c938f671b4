"""The client side of a split-learning iteration (SplitFed / FedLite).

Source: FedLite (Wang et al., 2022), Section 3 (SplitFed, Thapa et al. 2020)
steps 1, 2 and 4; Sections 4.1-4.2 (the quantizer and the mask ``M_i`` of
the gradient correction).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Literal, Mapping, Sequence

import fedjax
import jax
import jax.numpy as jnp
import numpy as np

from fedlite_jax.algorithms import batching, split_accounting
from fedlite_jax.transforms import pq
from fedlite_jax.transforms.product_quantization import product_quantization \
    as pq_transform
from fedlite_jax.common import PAD_ID

Batch = Mapping[str, Any]
ClientExecution = Literal['auto', 'vmap', 'unroll']
LambdaScaling = Literal['batch', 'example']


def loss_vector_mask(batch: Batch, activations: jax.Array) -> jax.Array:
  """Which activation vectors of one client carry training loss (``M_i``).

  For ``[B, T, d]`` activations with integer targets ``batch['y']`` of shape
  ``[B, T]``: the positions whose target is not PAD (id 0); else all.

  Args:
    batch: one client's batch.
    activations: its activations, ``[B, d]`` or ``[B, T, d]``.

  Returns:
    float32 0/1 of shape ``activations.shape[:-1]``.
  """
  lead = activations.shape[:-1]
  y = batch.get('y') if hasattr(batch, 'get') else None
  if (len(lead) == 2 and y is not None and tuple(y.shape) == tuple(lead) and
      jnp.issubdtype(y.dtype, jnp.integer)):
    return (y != PAD_ID).astype(jnp.float32)
  return jnp.ones(lead, jnp.float32)


def stack_batches(batches: Sequence[Batch]) -> dict[str, np.ndarray]:
  """The clients' batches stacked on a new leading axis (ValueError: keys
  differ)."""
  keys = set(batches[0])
  for b in batches[1:]:
    if set(b) != keys:
      raise ValueError(f'Clients have different batch keys: {sorted(keys)} vs '
                       f'{sorted(b)}.')
  return {k: np.stack([np.asarray(b[k]) for b in batches]) for k in keys}


def client_batch(dataset: fedjax.ClientDataset, batch_size: int,
                 rng: jax.Array) -> dict[str, np.ndarray]:
  """The one mini-batch (``B`` rows of NumPy arrays) a client uses.

  The first batch of a shuffle-repeat pass seeded from ``rng``
  (:func:`batching.shuffle_seed_from_rng`): ``B`` examples without
  replacement, or all plus re-drawn ones if fewer than B.

  Raises:
    ValueError: if the client has no examples.
  """
  hparams = fedjax.ShuffleRepeatBatchHParams(
      batch_size=batch_size, num_epochs=None, num_steps=1)
  return batching.client_batches(dataset, hparams, rng)[0]


def resolve_client_execution(execution: ClientExecution) -> str:
  """``'auto'`` -> ``'unroll'`` on CPU, ``'vmap'`` on GPU/TPU; ValueError
  for a value other than 'auto', 'vmap', 'unroll'."""
  if execution not in ('auto', 'vmap', 'unroll'):
    raise ValueError(f"client_execution must be 'auto', 'vmap' or 'unroll', "
                     f'got {execution!r}.')
  if execution == 'auto':
    return 'unroll' if jax.default_backend() == 'cpu' else 'vmap'
  return execution


def client_forward_vjp(client_apply, wc, batch, drop, execution: str):
  """Client forward of all clients and the VJP of their sum w.r.t. ``w_c``.

  Returns ``(z [C, ...], vjp)``, ``vjp(cot[C, ...]) = (sum_i cot_i^T
  dz_i/dw_c,)``; ``execution``: ``'vmap'`` or ``'unroll'`` (a Python loop).
  """
  if execution == 'vmap':
    return jax.vjp(
        lambda w: jax.vmap(client_apply, in_axes=(None, 0, 0))(w, batch, drop),
        wc)
  num_clients = drop.shape[0]
  zs, vjps = [], []
  for i in range(num_clients):
    batch_i = jax.tree.map(lambda x, i=i: x[i], batch)
    z_i, vjp_i = jax.vjp(
        lambda w, b=batch_i, k=drop[i]: client_apply(w, b, k), wc)
    zs.append(z_i)
    vjps.append(vjp_i)

  def vjp(cotangent):
    grads = [vjps[i](cotangent[i])[0] for i in range(num_clients)]
    return (jax.tree.map(lambda *g: functools.reduce(jnp.add, g), *grads),)

  return jnp.stack(zs), vjp


@dataclasses.dataclass(frozen=True)
class QuantizerConfig:
  """FedLite's quantization layer (Sections 4.1 and 4.2).

  Attributes:
    num_subvectors: ``q``, subvectors per activation vector (divides ``d``).
    num_groups: ``R``, groups sharing one codebook (divides ``q``; 1: the
      paper's default; ``q``: vanilla product quantization).
    num_centroids: ``L``, centroids per group (``1 <= L <= N q / R``).
    correction_lambda: ``lambda >= 0`` of equation 5; 0: straight-through.
    lambda_scaling: ``'example'`` (``lambda / B``: equation 5 per example,
      averaged as in Appendix B eq. 36) or ``'batch'``.
    kmeans_iters: Lloyd iterations per k-means (``>= 0``).
    empty_cluster: ``'farthest'`` or ``'keep'``
      (:mod:`fedlite_jax.transforms.kmeans`).

  Raises:
    ValueError: a value out of range.
  """
  num_subvectors: int
  num_groups: int = 1
  num_centroids: int = 2
  correction_lambda: float = 0.0
  lambda_scaling: LambdaScaling = 'example'
  kmeans_iters: int = pq.DEFAULT_NUM_ITERS
  empty_cluster: pq.EmptyClusterRule = 'farthest'

  def __post_init__(self):
    for name in ('num_subvectors', 'num_groups', 'num_centroids'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f'{name} must be an integer >= 1, got {value!r}.')
    if self.num_subvectors % self.num_groups:
      raise ValueError(f'num_groups (R) must divide num_subvectors '
                       f'q={self.num_subvectors}, got R={self.num_groups}.')
    lam = self.correction_lambda
    if (isinstance(lam, bool) or not isinstance(lam, (int, float)) or
        not math.isfinite(lam) or lam < 0):
      raise ValueError(f'correction_lambda must be a finite number >= 0, got '
                       f'{lam!r}.')
    if self.lambda_scaling not in ('batch', 'example'):
      raise ValueError(f"lambda_scaling must be 'batch' or 'example', got "
                       f'{self.lambda_scaling!r}.')
    if (isinstance(self.kmeans_iters, bool) or
        not isinstance(self.kmeans_iters, int) or self.kmeans_iters < 0):
      raise ValueError(f'kmeans_iters must be an integer >= 0, got '
                       f'{self.kmeans_iters!r}.')
    if self.empty_cluster not in ('farthest', 'keep'):
      raise ValueError(f"empty_cluster must be 'farthest' or 'keep', got "
                       f'{self.empty_cluster!r}.')

  @property
  def shape(self) -> split_accounting.PQShape:
    """``(q, R, L)`` as a :class:`~.split_accounting.PQShape`."""
    return split_accounting.PQShape(self.num_subvectors, self.num_groups,
                                    self.num_centroids)

  def validate(self, cut_size: int, num_vectors: int) -> None:
    """Checks ``q | d``, ``R | q`` and ``L <= N q / R`` (ValueError)."""
    pq.validate_pq_config(cut_size, num_vectors, self.num_subvectors,
                          self.num_groups, self.num_centroids)


def pq_upload(quantizer: QuantizerConfig, phi: float = pq.DEFAULT_PHI
              ) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """FedLite's upload of one client as ``(z [N, d], key) -> Z~ [N, d]``.

  ``transforms.product_quantization`` encoded then decoded (k-means key
  ``key``); jittable, vmappable.

  Args:
    quantizer: ``q, R, L``, Lloyd iterations and the empty-cluster rule.
    phi: bits per codebook float of the message size.
  """
  transform = pq_transform(
      quantizer.num_subvectors, quantizer.num_groups,
      quantizer.num_centroids, quantizer.kmeans_iters, phi=phi,
      empty_cluster=quantizer.empty_cluster, fold_leaf_index=False)

  def upload(z: jax.Array, key: jax.Array) -> jax.Array:
    state = transform.init(z)
    message, state = transform.encode(z, state, key)
    return transform.decode(message, state)[0]

  return upload
