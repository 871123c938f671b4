"""Gradient inversion ("deep leakage from gradients") against a client update.

Source: Melas-Kyriazi & Wang, "Intrinsic Gradient Compression for Federated
Learning" (2022), Appendix E: the attack of Zhu, Liu & Han, "Deep Leakage
from Gradients" (NeurIPS 2019; DLG) on the full gradient ``g`` and on the
compressed update ``A^T g``. Pure JAX + optax; deterministic given its key.
A library of ``experiments/igc_privacy.py``, its only user (not part of the
``fedlite_jax`` package).

Choices: the matching loss divides DLG's ``||grad' - grad||^2`` by the
constant ``||target||^2`` (same minimizers; the loss is a relative error
comparable across observation sizes); the observation's cross-entropy is
summed over the batch, as DLG's code does for its batch of one; the attacker
keeps the iterate with the lowest matching loss (no ground truth needed); a
non-finite objective freezes the iterate.
"""

from __future__ import annotations

import functools
from typing import Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree
from fedlite_jax.common import PyTree
from fedlite_jax.privacy import clip_by_global_norm
from fedlite_jax.privacy import gaussian_noise_like

__all__ = ['InversionResult', 'clipped_noised_observation',
           'gradient_inversion', 'gradient_observation', 'infer_label',
           'matching_loss', 'mse', 'psnr', 'total_variation']

Array = jax.Array
Observe = Callable[[Array, Array], PyTree]
OPTIMIZERS: tuple[str, ...] = ('lbfgs', 'adam')
INITS: tuple[str, ...] = ('normal', 'uniform')


class InversionResult(NamedTuple):
  """What :func:`gradient_inversion` returns.

  Attributes:
    x: float32 ``x_shape``, the iterate with the lowest objective seen (no
      ground truth needed to select it); not clipped to the data range.
    label_probs: ``float32[B, C]``, one-hot of the given labels or
      ``softmax`` of the optimized logits (DLG).
    losses: ``float32[num_steps]``, the objective before each step;
      NaN/inf marks a diverged step.
    best_loss: ``float32[]``, the objective at ``x``.
  """
  x: Array
  label_probs: Array
  losses: Array
  best_loss: Array


def mse(x: Array, reference: Array) -> Array:
  """Mean squared error over all entries, float32 scalar.

  Raises:
    ValueError: if the shapes of ``x`` and ``reference`` differ.
  """
  x = jnp.asarray(x, jnp.float32)
  reference = jnp.asarray(reference, jnp.float32)
  if x.shape != reference.shape:
    raise ValueError(f'shapes differ: {x.shape} vs {reference.shape}.')
  return jnp.mean(jnp.square(x - reference))


def psnr(x: Array, reference: Array, data_range: float = 1.0) -> Array:
  """Peak signal-to-noise ratio in dB: ``10 log10(data_range^2 / MSE)``.

  float32 scalar (``+inf`` for a zero MSE); ``reference`` in [0, data_range].
  """
  return 10.0 * jnp.log10(data_range**2 / mse(x, reference))


def total_variation(x: Array) -> Array:
  """Anisotropic total variation of images ``[B, H, W, C]``: mean |dx|+|dy|.

  The image prior used by later gradient-inversion attacks (Geiping et al.,
  "Inverting Gradients", NeurIPS 2020); DLG itself uses none (weight 0).
  """
  if x.ndim != 4:
    raise ValueError(f'total_variation expects [B, H, W, C]; got {x.shape}.')
  dy = jnp.abs(x[:, 1:, :, :] - x[:, :-1, :, :])
  dx = jnp.abs(x[:, :, 1:, :] - x[:, :, :-1, :])
  return jnp.mean(dy) + jnp.mean(dx)


def infer_label(last_layer_grad: Array) -> Array:
  """iDLG: the true class of a single example from the last-layer gradient.

  Source: Zhao, Mopuri & Bilen, "iDLG: Improved Deep Leakage from Gradients"
  (2020): ``dL/dz = softmax(z) - onehot(y)`` is negative only at ``y``; so
  is the bias gradient, and the kernel gradient summed over non-negative
  input features (sigmoid, relu).

  Args:
    last_layer_grad: float bias gradient ``[C]`` or kernel gradient ``[F, C]``
      of the last dense layer.

  Returns:
    int32 scalar: argmin over classes of the sum over the leading axes.

  Raises:
    ValueError: for a scalar gradient.
  """
  g = jnp.asarray(last_layer_grad)
  if g.ndim == 0:
    raise ValueError('last_layer_grad must have a class axis (last axis).')
  return jnp.argmin(jnp.sum(g.reshape(-1, g.shape[-1]), axis=0)).astype(
      jnp.int32)


def gradient_observation(
    apply_fn: Callable[[PyTree, Array], Array],
    params: PyTree,
    transform: Callable[[Array], PyTree] | None = None) -> Observe:
  """``(x, y) -> transform(ravel(grad_params CE(apply_fn(params, x), y)))``.

  CE is DLG's soft-label cross-entropy summed (not averaged) over the batch,
  ``-sum_b sum_c y[b, c] log_softmax(logits)[b, c]``.

  Args:
    apply_fn: deterministic ``apply_fn(params, x) -> logits float32[B, C]``.
    params: the point the client computes its gradient at (public).
    transform: applied to the raveled gradient ``float32[D]``, e.g.
      ``lambda g: fastfood_project(A, g)`` for the intrinsic upload ``A^T g``;
      None for the full gradient.

  Returns:
    ``observe(x [B, ...], y_probs float [B, C])``.
  """

  def loss(p, x, y_probs):
    logits = apply_fn(p, x)
    return -jnp.sum(y_probs * jax.nn.log_softmax(logits, axis=-1))

  def observe(x, y_probs):
    g = jax.grad(loss)(params, x, y_probs)
    flat, _ = ravel_pytree(g)
    return flat if transform is None else transform(flat)

  return observe


def clipped_noised_observation(
    observe: Observe, clip_norm: float, noise_std: float
) -> tuple[Observe, Callable[[Array, Array, Array], PyTree]]:
  """A DP-FedAvg client's update as the attacker sees it, and its model.

  McMahan et al. (2018), Alg. 1: the update is clipped to L2 norm ``C``
  (:func:`fedlite_jax.privacy.clip_by_global_norm`) and Gaussian noise
  (:func:`fedlite_jax.privacy.gaussian_noise_like`) is added. ``C`` is
  public, the noise is not: the attacker matches its candidate's *clipped*
  observation against the noised one.

  Args:
    observe: ``observe(x, y_probs) -> observation``, e.g.
      :func:`gradient_observation`.
    clip_norm: ``C`` > 0.
    noise_std: std of the noise on every entry (e.g. ``z * C``, from
      :func:`fedlite_jax.privacy.noise_std_on_sum`), >= 0.

  Returns:
    ``(clipped, noised)``: ``clipped(x, y_probs) = clip(observe(x, y_probs),
    C)`` (the attacker's model) and ``noised(x, y_probs, key) = clipped(x,
    y_probs) + N(0, noise_std^2 I)`` (the observed update; noise from
    ``key``).
  """

  def clipped(x, y_probs):
    return clip_by_global_norm(observe(x, y_probs), clip_norm)[0]

  def noised(x, y_probs, key):
    c = clipped(x, y_probs)
    return jax.tree.map(jnp.add, c, gaussian_noise_like(c, key, noise_std))

  return clipped, noised


def matching_loss(observation: PyTree, target: PyTree) -> Array:
  """``||observation - target||^2 / ||target||^2`` summed over pytree leaves.

  DLG's ``||grad' - grad||^2`` over a constant: same minimizers, comparable
  across observation sizes. A zero target gives the unnormalized distance.
  """
  diffs = jax.tree.leaves(jax.tree.map(
      lambda a, b: jnp.sum(jnp.square(a - b)), observation, target))
  norms = jax.tree.leaves(jax.tree.map(lambda b: jnp.sum(jnp.square(b)),
                                       target))
  num = functools.reduce(jnp.add, diffs)
  den = functools.reduce(jnp.add, norms)
  return num / jnp.where(den > 0, den, 1.0)


def _make_optimizer(optimizer: str, learning_rate: float | None,
                    max_linesearch_steps: int) -> optax.GradientTransformation:
  """L-BFGS (memory 100, zoom line search) or Adam (default lr 0.1)."""
  if optimizer == 'lbfgs':
    return optax.lbfgs(
        learning_rate=learning_rate, memory_size=100,
        linesearch=optax.scale_by_zoom_linesearch(
            max_linesearch_steps=max_linesearch_steps))
  return optax.adam(0.1 if learning_rate is None else learning_rate)


def gradient_inversion(
    observe: Observe,
    target: PyTree,
    key: Array,
    x_shape: tuple[int, ...],
    *,
    label: Array | None = None,
    num_classes: int | None = None,
    num_steps: int = 300,
    optimizer: Literal['lbfgs', 'adam'] = 'lbfgs',
    learning_rate: float | None = None,
    init: Literal['normal', 'uniform'] = 'normal',
    tv_weight: float = 0.0,
    max_linesearch_steps: int = 20,
) -> InversionResult:
  """Reconstructs a client's input from an observed update (DLG attack).

  Source: Melas-Kyriazi & Wang (2022), Appendix E, running Zhu et al.
  (2019), Algorithm 1: minimize ``matching_loss(observe(x', y'), target) +
  tv_weight * TV(x')`` over the dummy input ``x'`` (and, without ``label``,
  soft label logits, drawn ~ N(0, 1) from ``key`` as ``x'``). One
  ``lax.scan``; a non-finite objective freezes the iterate. Traced per call:
  ``jax.jit`` a closure over the static arguments, or ``jax.vmap`` over
  ``(target, key, label)``.

  Args:
    observe: ``observe(x, y_probs) -> observation`` (a pytree of float
      arrays), reverse-differentiable; see :func:`gradient_observation`.
    target: the observed update, same structure as ``observe``'s output.
    key: a JAX PRNG key (the dummy initialization).
    x_shape: shape of the dummy input, e.g. ``(1, 28, 28, 1)``.
    label: known labels, int ``[B]`` or fixed float ``[B, C]``
      probabilities; None: optimize soft labels jointly (DLG).
    num_classes: C; required unless ``label`` is a ``[B, C]`` float array.
    num_steps: optimizer steps (L-BFGS iterations or Adam steps), >= 1.
    optimizer: ``'lbfgs'`` (DLG's; ``optax.lbfgs``, memory 100, zoom line
      search) or ``'adam'``.
    learning_rate: L-BFGS: None lets the line search pick the step
      (recommended); Adam: default 0.1.
    init: ``'normal'`` (DLG's ``torch.randn``) or ``'uniform'`` (U[0, 1)).
    tv_weight: weight of :func:`total_variation` (images ``[B, H, W, C]``
      only); 0 is DLG.
    max_linesearch_steps: L-BFGS line-search budget per step.

  Returns:
    An :class:`InversionResult`.

  Raises:
    ValueError: on an unknown optimizer or init, ``num_steps < 1``, or a
      missing ``num_classes``.
  """
  if optimizer not in OPTIMIZERS:
    raise ValueError(f'optimizer must be one of {OPTIMIZERS}; got '
                     f'{optimizer!r}.')
  if init not in INITS:
    raise ValueError(f'init must be one of {INITS}; got {init!r}.')
  if num_steps < 1:
    raise ValueError(f'num_steps must be >= 1; got {num_steps}.')
  batch = x_shape[0]
  fixed_probs = None
  if label is not None:
    label = jnp.asarray(label)
    if jnp.issubdtype(label.dtype, jnp.integer):
      if num_classes is None:
        raise ValueError('integer labels need num_classes.')
      fixed_probs = jax.nn.one_hot(label, num_classes, dtype=jnp.float32)
    else:
      fixed_probs = label.astype(jnp.float32)
  elif num_classes is None:
    raise ValueError('joint label optimization (label=None) needs '
                     'num_classes.')

  kx, ky = jax.random.split(key)
  draw = jax.random.normal if init == 'normal' else jax.random.uniform
  variables = {'x': draw(kx, x_shape, jnp.float32)}
  if fixed_probs is None:
    variables['label_logits'] = jax.random.normal(
        ky, (batch, num_classes), jnp.float32)

  def probs_of(v):
    if fixed_probs is not None:
      return fixed_probs
    return jax.nn.softmax(v['label_logits'], axis=-1)

  def objective(v):
    value = matching_loss(observe(v['x'], probs_of(v)), target)
    if tv_weight:
      value = value + tv_weight * total_variation(v['x'])
    return value

  opt = _make_optimizer(optimizer, learning_rate, max_linesearch_steps)
  value_and_grad = (optax.value_and_grad_from_state(objective)
                    if optimizer == 'lbfgs' else jax.value_and_grad(objective))

  def step(carry, _):
    v, state, best_v, best_loss, alive = carry
    if optimizer == 'lbfgs':
      value, grad = value_and_grad(v, state=state)
      updates, new_state = opt.update(grad, state, v, value=value, grad=grad,
                                      value_fn=objective)
    else:
      value, grad = value_and_grad(v)
      updates, new_state = opt.update(grad, state, v)
    finite = jnp.isfinite(value)
    better = finite & (value < best_loss)
    best_v = jax.tree.map(lambda a, b: jnp.where(better, a, b), v, best_v)
    best_loss = jnp.where(better, value, best_loss)
    alive = alive & finite
    new_v = optax.apply_updates(v, updates)
    new_v = jax.tree.map(lambda a, b: jnp.where(alive, a, b), new_v, v)
    new_state = jax.tree.map(lambda a, b: jnp.where(alive, a, b), new_state,
                             state)
    return (new_v, new_state, best_v, best_loss, alive), value

  carry0 = (variables, opt.init(variables), variables,
            jnp.asarray(jnp.inf, jnp.float32), jnp.asarray(True))
  (v, _, best_v, best_loss, alive), losses = jax.lax.scan(
      step, carry0, None, length=num_steps)
  # The last iterate has not been scored inside the loop.
  last = objective(v)
  better = alive & jnp.isfinite(last) & (last < best_loss)
  best_v = jax.tree.map(lambda a, b: jnp.where(better, a, b), v, best_v)
  best_loss = jnp.where(better, last, best_loss)
  return InversionResult(x=best_v['x'], label_probs=probs_of(best_v),
                         losses=losses, best_loss=best_loss)
