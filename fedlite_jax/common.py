"""Names shared across the package: the pytree alias, bit and token
constants, and the key streams of each random choice. Lowest layer.
"""

from __future__ import annotations

from typing import Any

__all__ = ['PyTree', 'FLOAT_BITS', 'PAD_ID', 'UPLOAD_STREAM',
           'DOWNLOAD_STREAM', 'GRAD_UPLOAD_STREAM', 'COMPRESS_STREAM',
           'PVT_STREAM', 'DP_STREAM']

PyTree = Any
"""A JAX pytree (nested dicts/lists/tuples of arrays)."""

FLOAT_BITS = 32
"""Bits of one uncompressed float (float32) in every bit count."""

PAD_ID = 0
"""Token id of padding in every language-model vocabulary and batch."""

# Key streams: jax.random.fold_in(key, stream) separates the random choices
# of one (seed, round, client) key by purpose.
UPLOAD_STREAM = 0x75706C64  # 'upld'
DOWNLOAD_STREAM = 0x646F776E  # 'down'
GRAD_UPLOAD_STREAM = 0x67726164  # 'grad'
# IGC's subspace choice and FetchSGD's sketch.
COMPRESS_STREAM = 0x636F6D70  # 'comp'
# PVT's mask key: the client's training stream stays untouched, so PVT 100%
# reproduces FedAvg's dropout/shuffle draws.
PVT_STREAM = 0x70767421  # 'pvt!'
# DP-FedAvg's server noise: fold_in(fold_in(PRNGKey(seed), DP_STREAM), round).
DP_STREAM = 0x64702121  # 'dp!!'
