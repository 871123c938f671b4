"""Intrinsic gradient compression: the pure-math core (no FedJAX dependency).

Melas-Kyriazi & Wang, "Intrinsic Gradient Compression for Federated
Learning" (2022): gradients are compressed to ``A^T g`` (d numbers) and
decompressed with ``A``, a D x d Fastfood matrix regenerated from a shared
seed. ``fwht`` here is the submodule (``from fedlite_jax.igc.fwht import
fwht`` for the function); the communication transform is
:func:`fedlite_jax.transforms.intrinsic_projection`.
"""

from fedlite_jax.igc import fwht  # the submodule
from fedlite_jax.igc.fastfood import FastfoodParams
from fedlite_jax.igc.fastfood import fastfood_lift
from fedlite_jax.igc.fastfood import fastfood_params
from fedlite_jax.igc.fastfood import fastfood_project
from fedlite_jax.igc.fastfood import padded_length
from fedlite_jax.igc.fastfood import SCALES
from fedlite_jax.igc.reparameterization import intrinsic_lift
from fedlite_jax.igc.reparameterization import intrinsic_project
from fedlite_jax.igc.reparameterization import intrinsic_subspace
from fedlite_jax.igc.reparameterization import intrinsic_to_params
from fedlite_jax.igc.reparameterization import IntrinsicSubspace
from fedlite_jax.igc.reparameterization import make_intrinsic

__all__ = ['FastfoodParams', 'IntrinsicSubspace', 'SCALES', 'fastfood_lift',
           'fastfood_params', 'fastfood_project', 'fwht', 'intrinsic_lift',
           'intrinsic_project', 'intrinsic_subspace', 'intrinsic_to_params',
           'make_intrinsic', 'padded_length']
