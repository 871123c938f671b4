"""The experiment runner behind ``experiments/run_experiment.py``.

Usable without absl: build a :class:`RunConfig` and call :func:`run`. Its
modules import only those below them (``tests/test_layering.py``).
"""

from fedlite_jax.training.config import ConfigError
from fedlite_jax.training.config import RunConfig
from fedlite_jax.training.loop import RunInterrupted
from fedlite_jax.training.runner import run
