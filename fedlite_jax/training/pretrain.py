"""Centralized pretraining on another corpus (transfer learning, phase 1).

Source: Ro et al. (2022), Sec. 5 and App. D. Corpus ``'python_help'``:
CPython's help topics (``pydoc_data``; ~0.46 MB of technical English, a
domain other than Shakespeare), encoded with the federated task's tokenizer.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Sequence

import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import optax

CORPORA = ('python_help',)


def python_help_paragraphs() -> list[str]:
  """CPython's help topics as whitespace-normalized paragraphs, sorted by
  topic."""
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top
  out = []
  for name in sorted(topics.topics):
    for para in topics.topics[name].split('\n\n'):
      para = ' '.join(para.split())
      if para:
        out.append(para)
  return out


def corpus_texts(name: str) -> list[str]:
  """The texts of a named corpus (ValueError naming the allowed ones)."""
  if name == 'python_help':
    return python_help_paragraphs()
  raise ValueError(f'Unknown pretraining corpus {name!r}; allowed: '
                   f'{", ".join(CORPORA)}.')


def encode_chunks(piece_ids: Sequence[Sequence[int]], max_length: int, *,
                  bos_id: int = 1, eos_id: int = 2
                  ) -> dict[str, np.ndarray]:
  """Cuts each text's ids into next-token examples: each chunk ``c`` of
  ``max_length - 1`` ids gives ``x = [BOS] + c`` and ``y = c + [EOS]``,
  PAD-padded; ``{'x', 'y'}`` int32 [num_chunks, max_length].

  Raises:
    ValueError: max_length < 2.
  """
  if max_length < 2:
    raise ValueError(f'max_length must be >= 2, got {max_length}.')
  xs, ys = [], []
  step = max_length - 1
  for ids in piece_ids:
    ids = list(ids)
    for s in range(0, max(len(ids), 1), step):
      chunk = ids[s:s + step]
      x = np.zeros(max_length, np.int32)
      y = np.zeros(max_length, np.int32)
      x[:len(chunk) + 1] = [bos_id] + chunk
      y[:len(chunk) + 1] = chunk + [eos_id]
      xs.append(x)
      ys.append(y)
  return {'x': np.stack(xs), 'y': np.stack(ys)}


def pretrain(model: fedjax.Model, params: Any, data: dict[str, np.ndarray],
             *, steps: int, batch_size: int = 16, learning_rate: float = 1e-3,
             clip_norm: float = 0.0, seed: int = 0, log_every: int = 0,
             log: Callable[[str], None] = print) -> tuple[Any, dict]:
  """Centralized Adam training on shuffled batches (Ro et al., App. D).

  Args:
    model: the ``fedjax.Model``; ``params`` its initial parameters.
    data: ``{'x', 'y'}`` int32 [N, L].
    steps: optimizer steps (>= 1).
    batch_size: examples per step (paper: 16).
    learning_rate: Adam step size (paper: 5e-5..1e-4 for 30M steps).
    clip_norm: global-norm gradient clipping (0 = off; paper: 0 or 16).
    seed: shuffling seed.
    log_every: ``log`` the running loss every N steps (0 = never).

  Returns:
    ``(params, {'steps', 'examples', 'seconds', 'final_train_loss'})``, the
    loss averaged over the last ``min(100, steps)`` steps.

  Raises:
    ValueError: steps or batch_size < 1, or fewer examples than a batch.
  """
  if steps < 1 or batch_size < 1:
    raise ValueError(f'steps and batch_size must be >= 1, got {steps}, '
                     f'{batch_size}.')
  n = len(data['x'])
  if n < batch_size:
    raise ValueError(f'{n} pretraining examples, fewer than batch_size='
                     f'{batch_size}.')
  opt = optax.adam(learning_rate, b1=0.9, b2=0.999, eps=1e-8)
  if clip_norm > 0:
    opt = optax.chain(optax.clip_by_global_norm(clip_norm), opt)
  opt_state = opt.init(params)

  def loss_fn(p, batch, rng):
    preds = model.apply_for_train(p, batch, rng)
    return jnp.mean(model.train_loss(batch, preds))

  @jax.jit
  def step(p, s, batch, rng):
    loss, grads = jax.value_and_grad(loss_fn)(p, batch, rng)
    updates, s = opt.update(grads, s, p)
    return optax.apply_updates(p, updates), s, loss

  def batches() -> Iterator[dict[str, np.ndarray]]:
    rs = np.random.RandomState(seed)
    while True:
      order = rs.permutation(n)
      for i in range(0, n - batch_size + 1, batch_size):
        idx = order[i:i + batch_size]
        yield {k: v[idx] for k, v in data.items()}

  key = jax.random.PRNGKey(seed)
  losses = []
  start = time.perf_counter()
  for i, batch in zip(range(steps), batches()):
    params, opt_state, loss = step(params, opt_state, batch,
                                   jax.random.fold_in(key, i))
    losses.append(loss)
    if log_every and (i + 1) % log_every == 0:
      log(f'pretrain step {i + 1}/{steps}: loss '
          f'{float(np.mean(jax.device_get(losses[-log_every:]))):.3f}')
  jax.block_until_ready(params)
  tail = jax.device_get(losses[-min(100, steps):])
  return params, {'steps': steps, 'examples': n,
                  'seconds': time.perf_counter() - start,
                  'final_train_loss': float(np.mean(tail))}
