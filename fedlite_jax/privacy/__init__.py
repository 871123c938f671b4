"""Differential privacy that composes with compression.

Central DP-FedAvg aggregation (clip, sum, Gaussian noise on the sum; McMahan
et al. 2018), adaptive clipping (Andrew et al. 2021), the one server step
both DP-FedAvg entry points run (:func:`dp_noised_mean` with
:class:`DPSettings`), accounting with
Google's ``dp-accounting`` (RDP by default, PLD as an option; noise
calibration from a target epsilon) and the sensitivity rule for where the
clip sits relative to a compression chain; distributed DP under secure
aggregation (the distributed discrete Gaussian of Kairouz et al. 2021 and the
Skellam mechanism of Agarwal et al. 2021: the client's encoding, the exact
samplers, the modular secure sum and their RDP accounting). Plain JAX plus
``dp_accounting``:
this package sits below ``fedlite_jax.algorithms`` and imports no FedJAX.

Modules: :mod:`~fedlite_jax.privacy.aggregation`,
:mod:`~fedlite_jax.privacy.accounting`,
:mod:`~fedlite_jax.privacy.sensitivity`,
:mod:`~fedlite_jax.privacy.distributed`,
:mod:`~fedlite_jax.privacy.discrete_noise`,
:mod:`~fedlite_jax.privacy.skellam_noise`,
:mod:`~fedlite_jax.privacy.ddp_accounting`.
"""

from fedlite_jax.privacy.accounting import ACCOUNTANTS
from fedlite_jax.privacy.accounting import adaptive_clipping_event
from fedlite_jax.privacy.accounting import calibrate_noise_multiplier
from fedlite_jax.privacy.accounting import dp_fedavg_event
from fedlite_jax.privacy.accounting import epsilon
from fedlite_jax.privacy.accounting import event_epsilon
from fedlite_jax.privacy.accounting import make_accountant
from fedlite_jax.privacy.accounting import sampling_probability
from fedlite_jax.privacy.aggregation import adaptive_clip_update
from fedlite_jax.privacy.aggregation import AdaptiveClipResult
from fedlite_jax.privacy.aggregation import check_dp_params
from fedlite_jax.privacy.aggregation import clip_by_global_norm
from fedlite_jax.privacy.aggregation import dp_fedavg_aggregate
from fedlite_jax.privacy.aggregation import dp_noised_mean
from fedlite_jax.privacy.aggregation import dp_round_key
from fedlite_jax.privacy.aggregation import DPAggregate
from fedlite_jax.privacy.aggregation import DPMean
from fedlite_jax.privacy.aggregation import DPSettings
from fedlite_jax.privacy.aggregation import effective_delta_noise_multiplier
from fedlite_jax.privacy.aggregation import gaussian_noise_like
from fedlite_jax.privacy.aggregation import global_norm
from fedlite_jax.privacy.aggregation import noise_std_on_sum
from fedlite_jax.privacy.aggregation import noised_unclipped_fraction
from fedlite_jax.privacy.distributed import calibrate_secure
from fedlite_jax.privacy.distributed import decode_sum
from fedlite_jax.privacy.distributed import DistributedDP
from fedlite_jax.privacy.distributed import encode_update
from fedlite_jax.privacy.distributed import MECHANISMS
from fedlite_jax.privacy.distributed import padded_dim
from fedlite_jax.privacy.distributed import secure_epsilon
from fedlite_jax.privacy.distributed import secure_settings
from fedlite_jax.privacy.distributed import wrapped_fraction
from fedlite_jax.privacy.sensitivity import clip_sensitivity
from fedlite_jax.privacy.sensitivity import Sensitivity
from fedlite_jax.privacy.sensitivity import stage_names

__all__ = [
    'ACCOUNTANTS',
    'AdaptiveClipResult',
    'DPAggregate',
    'DPMean',
    'DPSettings',
    'DistributedDP',
    'MECHANISMS',
    'Sensitivity',
    'adaptive_clip_update',
    'adaptive_clipping_event',
    'calibrate_secure',
    'calibrate_noise_multiplier',
    'check_dp_params',
    'clip_by_global_norm',
    'clip_sensitivity',
    'decode_sum',
    'dp_fedavg_aggregate',
    'dp_fedavg_event',
    'dp_noised_mean',
    'dp_round_key',
    'effective_delta_noise_multiplier',
    'encode_update',
    'epsilon',
    'event_epsilon',
    'gaussian_noise_like',
    'global_norm',
    'make_accountant',
    'noise_std_on_sum',
    'noised_unclipped_fraction',
    'padded_dim',
    'sampling_probability',
    'secure_epsilon',
    'secure_settings',
    'stage_names',
    'wrapped_fraction',
]
