"""Registers the built-in algorithms with the runner (see ``registry``).

Each method lives in its own module; this one only imports them so that
their ``register`` calls run.
"""

from fedlite_jax.training import algo_fedavg  # noqa: F401
from fedlite_jax.training import algo_lm  # noqa: F401
from fedlite_jax.training import algo_baselines  # noqa: F401
from fedlite_jax.training import algo_igc  # noqa: F401
from fedlite_jax.training import algo_splitfed  # noqa: F401
