"""fedlite_jax: communication-efficient federated learning on JAX + FedJAX.

Importing it first applies :mod:`fedlite_jax.compat` (FedJAX 0.0.17 on
current JAX and NumPy), so import it before ``fedjax``, and tunes glibc's
allocator for XLA:CPU (:mod:`fedlite_jax.cpu_allocator`), so import it before
running JAX computations. Subpackages are imported on first attribute access.
"""

import importlib

from fedlite_jax import compat as _compat
from fedlite_jax import cpu_allocator as _cpu_allocator

_compat.apply()
_cpu_allocator.configure()

__version__ = '0.1.0'

_SUBPACKAGES = ('algorithms', 'checkpoint', 'comm', 'datasets', 'models',
                'privacy', 'rounds', 'training', 'transforms')


def __getattr__(name: str):
  if name in _SUBPACKAGES:
    return importlib.import_module(f'{__name__}.{name}')
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def __dir__():
  return sorted(list(globals()) + list(_SUBPACKAGES))
