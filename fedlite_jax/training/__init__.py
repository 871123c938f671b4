"""The experiment runner behind ``experiments/run_experiment.py``.

Usable without absl: build a :class:`RunConfig` and call :func:`run`.

Modules, each importing only those above it (``tests/test_layering.py``):

  spec                  Option, AlgorithmSpec, BuildContext, ConfigError
  optimizers            optax optimizers and local batching from a RunConfig
  compression_options   options shared by several algorithms, their parsing
  algo_*                the algorithms, as ``SPECS`` (builders + options)
  registry              collects ``SPECS``; ``register`` for your own
  config                RunConfig, resolved and validated
  evaluation, lm_tasks, tasks, init_params, outputs, pretrain
  runner                :func:`run`
"""

from fedlite_jax.training.config import ConfigError
from fedlite_jax.training.config import RunConfig
from fedlite_jax.training.runner import run
