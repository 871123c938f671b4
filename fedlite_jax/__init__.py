"""fedlite_jax: communication-efficient federated learning on JAX + FedJAX.

Importing this package first applies :mod:`fedlite_jax.compat`, which makes
FedJAX 0.0.17 run on current JAX and NumPy; import ``fedlite_jax`` before (or
instead of) ``fedjax``.
"""

from fedlite_jax import compat as _compat

_compat.apply()

__version__ = '0.1.0'
