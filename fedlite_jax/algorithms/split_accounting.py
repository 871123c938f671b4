"""Communication of one split-learning iteration, per client, in bits.

Source: FedLite (Wang et al., 2022), Section 3 ("the communication size per
client per iteration can be written as |w_c| + B d"), Section 4.1 (message
size ``phi d R L / q + B q log2 L`` against ``phi d B``) and Section 5
("Overall communication": at q = 1,152, L = 2 on FEMNIST the activation upload
shrinks 490x, the whole upload 10x against SplitFed and 62x against FedAvg).

What one sampled client transfers in one iteration (one runner round):

upload
  * activations: SplitFed ``N d`` floats; FedLite the codebook ``R L d / q``
    floats plus the codewords ``N q log2 L`` bits. ``N`` is the number of
    activation vectors: the batch size ``B`` for classifiers, ``B T`` for the
    next-word-prediction LSTM (one vector per token position, PAD positions
    included, as in the paper's 128 x 30 = 3,840).
  * labels: ``label_elements x bits_per_label`` (the paper sends labels "if
    necessary" and leaves them out of all its ratios; so do the ``paper_*``
    quantities here).
  * client-model synchronization: the client-side gradient, ``|w_c|`` floats
    (the ``|w_c|`` of Section 3).
download (not counted by the paper, which only discusses the up-link)
  * the gradient with respect to the (quantized) activations, ``N d`` floats;
  * the current client-side model at the start of the iteration, ``|w_c|``
    floats (the synchronized model every sampled client needs).

Two float widths are used on purpose: the ledger (``upload_bits``,
``download_bits`` and the unprefixed keys) counts what this implementation
would put on the wire, ``float_bits = 32`` per float; the ``paper_*`` keys use
the paper's ``phi`` (64 in all its ratios, footnote 3), and only they reproduce
490.2x / 247x / 51.3x / 10.6x / 62.9x. Codeword bits do not scale with the
float width, so the two activation ratios differ (FEMNIST q = 1,152, L = 2:
490.2x at phi = 64, 250.4x at 32 bits).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional

from fedlite_jax.checks import check_int
from fedlite_jax.fedlite import pq

#: Bits per float in the ledger (float32 on the wire).
LEDGER_FLOAT_BITS = 32

#: Per-client diagnostics keys holding bits, summed over client-iterations by
#: the runner and passed to :func:`communication_summary`.
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
  """Bits one client transfers in one iteration (see the module docstring).

  All fields are bits (Python floats). Unprefixed fields use the ledger's
  32-bit floats; ``paper_*`` fields use ``phi`` bits per float.
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
    out = {f.name: float(getattr(self, f.name))
           for f in dataclasses.fields(self)}
    out['upload_bits'] = float(self.upload_bits)
    out['download_bits'] = float(self.download_bits)
    return out


def skipped_client_bits(bits: IterationBits) -> dict[str, float]:
  """Diagnostics entries of a client skipped for a non-finite update.

  It downloaded the client-side model at the start of the iteration, then
  sent nothing (no activations, labels or client gradient) and received no
  activation gradient: every :data:`BIT_KEYS` entry is 0 except
  ``client_model_download_bits`` and ``download_bits`` (equal to it). The
  ``paper_*`` entries, which only feed upload ratios, are 0 as well.

  Args:
    bits: the client's bits had it taken part (:func:`iteration_bits`).

  Returns:
    ``{key: bits}`` keyed as :data:`BIT_KEYS`.
  """
  zeros = {f.name: 0.0 for f in dataclasses.fields(bits)}
  zeros['client_model_download_bits'] = bits.client_model_download_bits
  return dataclasses.replace(bits, **zeros).diagnostics()


def iteration_bits(*,
                   cut_size: int,
                   num_vectors: int,
                   num_client_params: int,
                   num_params: int,
                   quantizer: Optional[PQShape] = None,
                   phi: float = pq.DEFAULT_PHI,
                   float_bits: float = LEDGER_FLOAT_BITS,
                   label_elements: int = 0,
                   bits_per_label: float = 0.0) -> IterationBits:
  """Bits one client transfers in one SplitFed / FedLite iteration.

  Args:
    cut_size: ``d``, the size of one activation vector.
    num_vectors: ``N``, activation vectors per client (``B``, or ``B T`` for
      sequence models).
    num_client_params: ``|w_c|``, parameters of the client-side model.
    num_params: ``|w|``, parameters of the whole model (FedAvg's upload).
    quantizer: the FedLite quantizer's sizes, or None for SplitFed.
    phi: bits per float in the paper's ratios (64 in the paper).
    float_bits: bits per float in the ledger (32).
    label_elements: label entries uploaded per client (0: labels not sent).
    bits_per_label: bits per label entry.

  Returns:
    An :class:`IterationBits`.

  Raises:
    ValueError: for a non-positive size, ``num_client_params > num_params``,
      bad ``phi`` / ``float_bits`` / label sizes, or an invalid quantizer
      (``q`` not dividing ``d``, ``R`` not dividing ``q``, ``L`` outside
      ``[1, N q / R]``; see :func:`fedlite_jax.fedlite.pq.validate_pq_config`).
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
    totals: the sums over all client-iterations of the :data:`BIT_KEYS`
      entries of the per-client diagnostics (missing keys count as 0).

  Returns:
    ``activation_compression`` (the paper's ratio, at ``phi``),
    ``activation_compression_ledger`` (same at the ledger's 32-bit floats),
    ``upload_compression_vs_splitfed`` and ``upload_compression_vs_fedavg``
    (whole upload incl. client-model sync, at ``phi``, labels excluded as in
    the paper), ``label_upload_bytes``; NaN where a denominator is 0.
  """
  def get(key: str) -> float:
    return float(totals.get(key, 0.0))

  def ratio(num: float, den: float) -> float:
    return num / den if den > 0 else math.nan

  paper_up = get('paper_activation_bits') + get('paper_client_model_bits')
  return {
      'activation_compression': ratio(
          get('paper_activation_bits_uncompressed'),
          get('paper_activation_bits')),
      'activation_compression_ledger': ratio(
          get('activation_bits_uncompressed'), get('activation_bits')),
      'upload_compression_vs_splitfed': ratio(
          get('paper_activation_bits_uncompressed') +
          get('paper_client_model_bits'), paper_up),
      'upload_compression_vs_fedavg': ratio(
          get('paper_fedavg_upload_bits'), paper_up),
      'label_upload_bytes': get('label_bits') / 8.0,
  }
