"""Total communication per client in gigabytes, as Ro et al. (2022) count it.

Source: Ro et al., "Scaling Language Model Size in Cross-Device Federated
Learning" (2022), Sec. 4 / App. C and Table 8 (totals after 10K rounds; 1 GB
= 10**9 bytes), e.g. 18.8M params x 32 bits x 10K rounds = 752 GB each way.
"""

from __future__ import annotations

import math

from fedlite_jax.comm.ledger import BITS_PER_BYTE, CommLedger

BYTES_PER_GB = 10**9


def paper_round_bits(num_params: float, bits_per_param: float,
                     trainable_fraction: float = 1.0) -> float:
  """Bits one client sends (or receives) in one round: ``N * f * b``.

  Raises:
    ValueError: a non-positive count or bits, or a fraction outside (0, 1].
  """
  if not num_params > 0 or not bits_per_param > 0:
    raise ValueError(f'num_params and bits_per_param must be > 0, got '
                     f'{num_params}, {bits_per_param}.')
  if not 0 < trainable_fraction <= 1:
    raise ValueError(f'trainable_fraction must be in (0, 1], got '
                     f'{trainable_fraction}.')
  return float(num_params) * float(trainable_fraction) * float(bits_per_param)


def paper_total_gb(num_params: float, bits_per_param: float, rounds: int,
                   trainable_fraction: float = 1.0) -> float:
  """Ro et al.'s total per client: ``N * f * b * rounds / 8 / 1e9`` GB.

  Args:
    num_params: N, model parameters (e.g. 18.8e6).
    bits_per_param: b (32 uncompressed; 8 for 8-bit uniform; log2(3) for
      TernGrad).
    rounds: communication rounds (Table 8: 10,000).
    trainable_fraction: f, PVT's trained share on upload (1 = all).

  Returns:
    Gigabytes (10**9 bytes).

  Raises:
    ValueError: as :func:`paper_round_bits`, or rounds < 0.
  """
  if rounds < 0:
    raise ValueError(f'rounds must be >= 0, got {rounds}.')
  return (paper_round_bits(num_params, bits_per_param, trainable_fraction)
          * rounds / BITS_PER_BYTE / BYTES_PER_GB)


def ledger_gb_per_client(ledger: CommLedger) -> dict[str, float]:
  """A ledger's totals as GB per client over the run (Table 8's unit).

  Per client = total / (client participations / rounds).

  Returns:
    ``{'upload_gb': ..., 'download_gb': ...}`` (NaN before any round).
  """
  if ledger.client_rounds == 0:
    return {'upload_gb': math.nan, 'download_gb': math.nan}
  clients_per_round = ledger.client_rounds / ledger.rounds
  scale = 1.0 / clients_per_round / BITS_PER_BYTE / BYTES_PER_GB
  return {'upload_gb': ledger.upload_bits * scale,
          'download_gb': ledger.download_bits * scale}
