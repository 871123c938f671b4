"""Optimizers and local batching from a RunConfig (shared by algorithms)."""

from __future__ import annotations

from typing import Optional

import fedjax
import optax

from fedlite_jax.training import compression_options
from fedlite_jax.training import spec

ConfigError = spec.ConfigError


def make_optimizer(name: str, lr: float, *, beta1: float = 0.9,
                   beta2: float = 0.999, eps: Optional[float] = None,
                   clip_norm: float = 0.0) -> optax.GradientTransformation:
  """optax optimizer by name ('sgd', 'adam', 'adagrad', 'yogi'; else
  ConfigError); ``eps=None``: optax's default; ``clip_norm > 0`` prepends
  ``optax.clip_by_global_norm``."""
  kw = {} if eps is None else {'eps': eps}
  if name == 'sgd':
    opt = optax.sgd(lr)
  elif name == 'adam':
    opt = optax.adam(lr, b1=beta1, b2=beta2, **kw)
  elif name == 'adagrad':
    opt = optax.adagrad(lr, **kw)
  elif name == 'yogi':
    opt = optax.yogi(lr, b1=beta1, b2=beta2, **kw)
  else:
    raise ConfigError(f'Unknown optimizer {name!r}.')
  if clip_norm > 0:
    opt = optax.chain(optax.clip_by_global_norm(clip_norm), opt)
  return opt


def client_optimizer(config) -> optax.GradientTransformation:
  """``--client_optimizer`` / ``--client_lr`` / ``--client_clip_norm``."""
  return make_optimizer(config.client_optimizer, config.client_lr,
                        clip_norm=config.client_clip_norm)


def server_optimizer(config) -> optax.GradientTransformation:
  """``--server_optimizer`` / ``--server_lr`` / betas / eps."""
  return make_optimizer(config.server_optimizer, config.server_lr,
                        beta1=config.server_beta1, beta2=config.server_beta2,
                        eps=config.server_eps)


def client_batch_hparams(config) -> fedjax.ShuffleRepeatBatchHParams:
  """Local batching: ``--client_epochs`` passes, or with ``--local_steps=s
  > 0`` exactly ``s`` batches (data repeated as needed)."""
  steps = int(spec.option_value(config.options,
                                compression_options.LOCAL_STEPS))
  if steps > 0 and config.client_epochs != 1:
    raise ConfigError(f'--local_steps={steps} and --client_epochs='
                      f'{config.client_epochs} both set the local work; '
                      'pass one of them.')
  if steps > 0:
    return fedjax.ShuffleRepeatBatchHParams(
        batch_size=config.client_batch_size, num_epochs=None, num_steps=steps)
  return fedjax.ShuffleRepeatBatchHParams(
      batch_size=config.client_batch_size, num_epochs=config.client_epochs)
