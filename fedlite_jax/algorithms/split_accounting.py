"""Communication of one split-learning iteration, per client, in bits.

Source: FedLite (Wang et al., 2022), Section 3 (``|w_c| + B d`` per client
per iteration), Section 4.1 (message ``phi d R L / q + N q log2 L`` against
``phi d N``), Section 5 ("Overall communication"). Unprefixed keys count
32-bit floats (the ledger); ``paper_*`` keys the paper's ``phi`` (64).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional

from fedlite_jax.checks import check_int
from fedlite_jax.transforms import pq

LEDGER_FLOAT_BITS = 32  # Bits per float in the ledger (float32).

#: Per-client diagnostics keys holding bits (:func:`communication_summary`).
BIT_KEYS = (
    'upload_bits', 'download_bits',
    'activation_bits', 'activation_bits_uncompressed', 'label_bits',
    'client_model_upload_bits', 'gradient_download_bits',
    'client_model_download_bits',
    'paper_activation_bits', 'paper_activation_bits_uncompressed',
    'paper_client_model_bits', 'paper_fedavg_upload_bits',
)


@dataclasses.dataclass(frozen=True)
class PQShape:
  """The grouped product quantizer's sizes (Section 4.1).

  Attributes:
    num_subvectors: ``q``, subvectors per activation vector (divides ``d``).
    num_groups: ``R``, groups sharing a codebook (divides ``q``).
    num_centroids: ``L``, centroids per group.
  """
  num_subvectors: int
  num_groups: int
  num_centroids: int


@dataclasses.dataclass(frozen=True)
class IterationBits:
  """Bits one client transfers in one iteration (Python floats).

  Upload: activations (``N d`` floats, or FedLite's ``R L d / q`` floats +
  ``N q log2 L`` bits), labels, client gradient (``|w_c|`` floats).
  Download: activation gradient (``N d``) and client model (``|w_c|``).
  """
  activation_bits: float
  activation_bits_uncompressed: float
  label_bits: float
  client_model_upload_bits: float
  gradient_download_bits: float
  client_model_download_bits: float
  paper_activation_bits: float
  paper_activation_bits_uncompressed: float
  paper_client_model_bits: float
  paper_fedavg_upload_bits: float

  @property
  def upload_bits(self) -> float:
    """Activations + labels + client gradient (ledger floats)."""
    return (self.activation_bits + self.label_bits +
            self.client_model_upload_bits)

  @property
  def download_bits(self) -> float:
    """Activation gradient + client model (ledger floats)."""
    return self.gradient_download_bits + self.client_model_download_bits

  @property
  def activation_compression(self) -> float:
    """The paper's ratio ``phi d N / (phi d R L / q + N q log2 L)``."""
    return (self.paper_activation_bits_uncompressed /
            self.paper_activation_bits)

  @property
  def upload_compression_vs_splitfed(self) -> float:
    """``(phi N d + phi |w_c|) / (message + phi |w_c|)`` (Section 5: 10.6x)."""
    return ((self.paper_activation_bits_uncompressed +
             self.paper_client_model_bits) /
            (self.paper_activation_bits + self.paper_client_model_bits))

  @property
  def upload_compression_vs_fedavg(self) -> float:
    """``phi |w| / (message + phi |w_c|)`` (Section 5: 62.9x on FEMNIST)."""
    return (self.paper_fedavg_upload_bits /
            (self.paper_activation_bits + self.paper_client_model_bits))

  def diagnostics(self) -> dict[str, float]:
    """The per-client diagnostics entries, keyed as :data:`BIT_KEYS`."""
    return {**{f.name: float(getattr(self, f.name))
               for f in dataclasses.fields(self)},
            'upload_bits': float(self.upload_bits),
            'download_bits': float(self.download_bits)}


def skipped_client_bits(bits: IterationBits) -> dict[str, float]:
  """:data:`BIT_KEYS` entries of a client skipped for a non-finite update.

  ``bits`` (had it taken part) zeroed but for the client-model download.
  """
  zeros = {f.name: 0.0 for f in dataclasses.fields(bits)}
  zeros['client_model_download_bits'] = bits.client_model_download_bits
  return dataclasses.replace(bits, **zeros).diagnostics()


def iteration_bits(*, cut_size: int, num_vectors: int, num_client_params: int,
                   num_params: int, quantizer: Optional[PQShape] = None,
                   phi: float = pq.DEFAULT_PHI,
                   float_bits: float = LEDGER_FLOAT_BITS,
                   label_elements: int = 0,
                   bits_per_label: float = 0.0) -> IterationBits:
  """Bits one client transfers in one SplitFed / FedLite iteration.

  Args:
    cut_size: ``d``, the size of one activation vector.
    num_vectors: ``N``, activation vectors per client (``B``, or ``B T``).
    num_client_params: ``|w_c|``, parameters of the client-side model.
    num_params: ``|w|``, parameters of the whole model (FedAvg's upload).
    quantizer: the FedLite quantizer's sizes, or None for SplitFed.
    phi: bits per float in the paper's ratios (64 in the paper).
    float_bits: bits per float in the ledger (32).
    label_elements: label entries uploaded per client (0: not sent).
    bits_per_label: bits per label entry.

  Raises:
    ValueError: a non-positive size, ``num_client_params > num_params``,
      bad ``phi`` / ``float_bits`` / label sizes, or an invalid quantizer.
  """
  d = check_int(cut_size, 'cut_size (d)')
  n = check_int(num_vectors, 'num_vectors (N)')
  wc = check_int(num_client_params, 'num_client_params (|w_c|)')
  w = check_int(num_params, 'num_params (|w|)')
  if wc > w:
    raise ValueError(f'num_client_params={wc} exceeds num_params={w}.')
  for name, value in (('phi', phi), ('float_bits', float_bits)):
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0):
      raise ValueError(f'{name} (bits per float) must be a positive number, '
                       f'got {value!r}.')
  if label_elements < 0 or bits_per_label < 0:
    raise ValueError(f'label_elements={label_elements} and bits_per_label='
                     f'{bits_per_label} must be >= 0.')

  def act_bits(width: float) -> float:
    if quantizer is None:
      return pq.uncompressed_bits(d, n, width)
    return pq.pq_message_bits(d, n, quantizer.num_subvectors,
                              quantizer.num_groups, quantizer.num_centroids,
                              width)

  return IterationBits(
      activation_bits=act_bits(float_bits),
      activation_bits_uncompressed=pq.uncompressed_bits(d, n, float_bits),
      label_bits=float(label_elements) * float(bits_per_label),
      client_model_upload_bits=float(float_bits) * wc,
      gradient_download_bits=pq.uncompressed_bits(d, n, float_bits),
      client_model_download_bits=float(float_bits) * wc,
      paper_activation_bits=act_bits(phi),
      paper_activation_bits_uncompressed=pq.uncompressed_bits(d, n, phi),
      paper_client_model_bits=float(phi) * wc,
      paper_fedavg_upload_bits=float(phi) * w)


def communication_summary(totals: Mapping[str, float]) -> dict[str, float]:
  """Run-level ratios from per-client diagnostics summed over a run.

  Args:
    totals: :data:`BIT_KEYS` entries summed over client-iterations (missing
      keys count as 0).

  Returns:
    ``activation_compression`` (at ``phi``), ``activation_compression_ledger``
    (at 32 bits), ``upload_compression_vs_splitfed`` and
    ``upload_compression_vs_fedavg`` (whole upload, at ``phi``, labels
    excluded), ``label_upload_bytes``; NaN where a denominator is 0.
  """
  t = {key: float(totals.get(key, 0.0)) for key in BIT_KEYS}

  def ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan

  paper_up = t['paper_activation_bits'] + t['paper_client_model_bits']
  return {
      'activation_compression': ratio(
          t['paper_activation_bits_uncompressed'], t['paper_activation_bits']),
      'activation_compression_ledger': ratio(
          t['activation_bits_uncompressed'], t['activation_bits']),
      'upload_compression_vs_splitfed': ratio(
          t['paper_activation_bits_uncompressed'] +
          t['paper_client_model_bits'], paper_up),
      'upload_compression_vs_fedavg': ratio(
          t['paper_fedavg_upload_bits'], paper_up),
      'label_upload_bytes': t['label_bits'] / 8.0,
  }
