"""fedlite_jax: communication-efficient federated learning on JAX + FedJAX.

Importing it first applies :mod:`fedlite_jax.compat` (FedJAX 0.0.17 on
current JAX and NumPy), so import it before ``fedjax``. Subpackages are
imported on first attribute access.
"""

import importlib

from fedlite_jax import compat as _compat

_compat.apply()

__version__ = '0.1.0'

_SUBPACKAGES = ('algorithms', 'checkpoint', 'comm', 'datasets', 'models',
                'privacy', 'rounds', 'training', 'transforms')


def __getattr__(name: str):
  if name in _SUBPACKAGES:
    return importlib.import_module(f'{__name__}.{name}')
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
  return sorted(list(globals()) + list(_SUBPACKAGES))
