"""Gradient inversion ("deep leakage from gradients") against a client update.

Source: Melas-Kyriazi & Wang, "Intrinsic Gradient Compression for Federated
Learning" (2022), Appendix E: an attacker who sees a client's update runs the
iterative reconstruction of Zhu, Liu & Han, "Deep Leakage from Gradients"
(NeurIPS 2019; DLG), once on the full gradient ``g`` and once on the
compressed update ``A^T g``; the paper reports (one ImageNet image, ResNet-152,
d = 65,536) that the second reconstruction is much worse.

The attack (DLG, Algorithm 1 of Zhu et al.). Given an observation function
``observe(x, y)`` -- the public map from a client batch to what the attacker
sees, e.g. ``ravel(grad_theta CE(f_theta(x), y))`` for the full gradient or
``A^T ravel(grad_theta ...)`` for intrinsic compression with the public seed
-- and the observed value ``target = observe(x_true, y_true)``, minimize over
a dummy batch::

    min_{x', y'}  ||observe(x', y') - target||^2 / ||target||^2
                  + tv_weight * TV(x')

by L-BFGS (DLG's choice) or Adam, from a random ``x'``. The label is either
known (``label=`` integer classes; what "improved DLG" (iDLG, Zhao et al.
2020) reads off the last-layer gradient, see :func:`infer_label`) or, as in
DLG, a jointly optimized soft label ``y' = softmax(label_logits)``. The
normalization by ``||target||^2`` only rescales the objective (its minimizers
are DLG's); it makes the reported loss a relative matching error comparable
across observations of different sizes.

Everything here is pure JAX + optax (no FedJAX): the caller builds
``observe`` (see :func:`gradient_observation`) and passes a PRNG key, so an
attack is a deterministic function of its arguments.

Reconstruction error (:func:`mse`, :func:`psnr`) is measured on images in
``[0, 1]``; PSNR = ``10 log10(data_range^2 / MSE)`` dB.
"""

from __future__ import annotations

import functools
from typing import Callable, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.flatten_util import ravel_pytree
from fedlite_jax.common import PyTree

__all__ = [
    'InversionResult',
    'gradient_inversion',
    'gradient_observation',
    'infer_label',
    'matching_loss',
    'mse',
    'psnr',
    'total_variation',
]

Array = jax.Array
Observe = Callable[[Array, Array], PyTree]
OPTIMIZERS: tuple[str, ...] = ('lbfgs', 'adam')
INITS: tuple[str, ...] = ('normal', 'uniform')


class InversionResult(NamedTuple):
  """What :func:`gradient_inversion` returns.

  Attributes:
    x: the reconstruction, same shape and dtype as the dummy input
      (``x_shape``), float32; unconstrained (not clipped to the data range).
      It is the iterate with the lowest matching loss seen (the attacker can
      select it: the loss needs no ground truth).
    label_probs: ``float32[B, C]``, the label the attack used: one-hot of the
      given labels, or ``softmax`` of the optimized logits (DLG).
    losses: ``float32[num_steps]``, the objective before each step (relative
      matching error plus the TV term); NaN/inf entries mark a diverged step
      (the best iterate is still returned).
    best_loss: ``float32[]``, the objective at ``x``.
  """
  x: Array
  label_probs: Array
  losses: Array
  best_loss: Array


def mse(x: Array, reference: Array) -> Array:
  """Mean squared error, float32 scalar (mean over all entries).

  Args:
    x: reconstruction, any shape.
    reference: ground truth, same shape as ``x``.
  """
  x = jnp.asarray(x, jnp.float32)
  reference = jnp.asarray(reference, jnp.float32)
  if x.shape != reference.shape:
    raise ValueError(f'shapes differ: {x.shape} vs {reference.shape}.')
  return jnp.mean(jnp.square(x - reference))


def psnr(x: Array, reference: Array, data_range: float = 1.0) -> Array:
  """Peak signal-to-noise ratio in dB: ``10 log10(data_range^2 / MSE)``.

  Args:
    x: reconstruction, any shape.
    reference: ground truth, same shape, values in ``[0, data_range]``.
    data_range: the peak value (1.0 for images in [0, 1]).

  Returns:
    float32 scalar; ``+inf`` when the MSE is exactly zero.
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

  Zhao, Mopuri & Bilen, "iDLG: Improved Deep Leakage from Gradients" (2020):
  for softmax cross-entropy on one example, ``dL/dz = softmax(z) - onehot(y)``
  is negative only at ``y``. So is the bias gradient, and so is each row
  of the kernel gradient ``dL/dW = h (softmax(z) - onehot(y))^T`` summed over
  the input features when the features ``h`` are non-negative (sigmoid, relu).

  Args:
    last_layer_grad: the last dense layer's bias gradient ``[C]`` or kernel
      gradient ``[F, C]`` (flax layout: inputs x outputs), float.

  Returns:
    int32 scalar, the argmin over classes of the gradient summed over all
    leading axes.
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
  """The map ``(x, y) -> transform(ravel(grad_params CE(apply_fn(params, x), y)))``.

  The loss is DLG's soft-label cross-entropy summed over the batch,
  ``-sum_b sum_c y[b, c] log_softmax(logits)[b, c]`` (for a batch of one, the
  gradient a client with one example computes; the sum, not the mean, is
  the convention of the DLG reference code for its batch of one).

  Args:
    apply_fn: ``apply_fn(params, x) -> logits float32[B, C]``,
      deterministic (no dropout).
    params: the model's parameters (the point the client computes its
      gradient at; public to the attacker).
    transform: applied to the flattened gradient ``float32[D]`` (D =
      number of parameters, ``jax.flatten_util.ravel_pytree`` order), e.g.
      ``lambda g: fastfood_project(A, g)`` for the intrinsic upload ``A^T g``
      (``float32[d]``); None for the full gradient.

  Returns:
    ``observe(x, y_probs)`` with ``x`` the model input ``[B, ...]`` and
    ``y_probs`` float ``[B, C]`` (one-hot or soft labels).
  """

  def loss(p, x, y_probs):
    logits = apply_fn(p, x)
    return -jnp.sum(y_probs * jax.nn.log_softmax(logits, axis=-1))

  def observe(x, y_probs):
    g = jax.grad(loss)(params, x, y_probs)
    flat, _ = ravel_pytree(g)
    return flat if transform is None else transform(flat)

  return observe


def matching_loss(observation: PyTree, target: PyTree) -> Array:
  """``||observation - target||^2 / ||target||^2`` summed over pytree leaves.

  The DLG objective ``||grad' - grad||^2`` divided by the constant
  ``||target||^2`` (a relative error; 0 iff the observations are equal).
  A zero target gives the unnormalized squared distance.
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

  Melas-Kyriazi & Wang (2022), Appendix E, running Zhu et al. (2019),
  Algorithm 1: minimize ``matching_loss(observe(x', y'), target) + tv_weight *
  TV(x')`` over the dummy input ``x'`` (and, without ``label``, over soft
  label logits, DLG's joint optimization), starting from ``x' ~ N(0, 1)``
  (DLG's ``torch.randn``; ``init='uniform'``: U[0, 1)) and label logits
  ``~ N(0, 1)`` drawn from ``key``.

  Optimizers. ``'lbfgs'`` (DLG's choice): ``optax.lbfgs`` (memory 100) with
  a zoom line search (at most ``max_linesearch_steps`` extra function
  evaluations per step); ``learning_rate`` None lets the line search pick
  the step (recommended). ``'adam'``: ``optax.adam(learning_rate or 0.1)``.
  The loop is one ``jax.lax.scan`` of ``num_steps`` steps; a non-finite
  objective stops further updates (the iterate is frozen) and the lowest
  loss iterate is returned.

  Cost: each step evaluates ``observe`` and its reverse-mode derivative in
  ``x'`` once (L-BFGS: plus line-search evaluations), i.e. second-order
  differentiation through the model (grad of grad), plus one ``A^T`` and
  one ``A`` product per evaluation for intrinsic observations. The function
  is traced and compiled on each call; wrap it in ``jax.jit`` (with
  ``observe``, ``x_shape`` and the keyword arguments static, e.g. by closing
  over them) to attack many targets, or ``jax.vmap`` over ``(target, key,
  label)`` to attack a batch of clients at once.

  Args:
    observe: ``observe(x, y_probs) -> observation`` (a pytree of float
      arrays), differentiable in ``x`` and ``y_probs`` by reverse mode; see
      :func:`gradient_observation`.
    target: the observed update, same structure as ``observe``'s output.
    key: a JAX PRNG key (the attack's randomness: the dummy initialization).
    x_shape: shape of the dummy input, e.g. ``(1, 28, 28, 1)``.
    label: known labels, int ``[B]`` (with ``num_classes``), or a fixed
      label distribution float ``[B, C]``; None: optimize soft labels
      jointly (needs ``num_classes``).
    num_classes: C; required unless ``label`` is a ``[B, C]`` float array.
    num_steps: optimizer steps (L-BFGS iterations or Adam steps), >= 1.
    optimizer: ``'lbfgs'`` or ``'adam'``.
    learning_rate: see Optimizers above.
    init: ``'normal'`` (DLG) or ``'uniform'``.
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
  if init == 'normal':
    x0 = jax.random.normal(kx, x_shape, jnp.float32)
  else:
    x0 = jax.random.uniform(kx, x_shape, jnp.float32)
  variables = {'x': x0}
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
