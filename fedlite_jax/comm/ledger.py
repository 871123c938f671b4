"""The communication ledger: bits uploaded and downloaded per client per round.

Baseline: uncompressed FedAvg, ``32 * num_params`` bits each way per client.
``upload_compression = baseline upload bits / upload bits`` (also download).
``total_compression = 2 / (1/up + 1/down)``: Melas-Kyriazi & Wang, Table 2.
A skipped client (non-finite update) uploads nothing, in the baseline too.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Optional, TextIO
from fedlite_jax.common import FLOAT_BITS

BITS_PER_BYTE = 8


def total_compression(upload_compression: float,
                      download_compression: float) -> float:
  """``2 / (1/up + 1/down)``: IGC paper, Table 2 ("Total" column).

  Raises:
    ValueError: if a ratio is not positive.
  """
  if upload_compression <= 0 or download_compression <= 0:
    raise ValueError(
        f'Compression ratios must be > 0, got up={upload_compression}, '
        f'down={download_compression}.')
  return 2.0 / (1.0 / upload_compression + 1.0 / download_compression)


@dataclasses.dataclass
class CommLedger:
  """Running communication totals for a federated run.

  Attributes:
    num_params: number of scalar model parameters.
    upload_bits / download_bits: totals so far (bits).
    baseline_upload_bits / baseline_download_bits: uncompressed FedAvg totals
      over the same client-rounds (bits).
    client_rounds: (client, round) participations, skipped ones included.
    rounds: rounds recorded.
    extra_bits: sums of the per-client diagnostics named by its keys (fixed
      at creation; e.g. FedLite's ``activation_bits``; missing = 0).
    skipped_client_rounds: participations skipped as non-finite.
  """
  num_params: int
  upload_bits: float = 0.0
  download_bits: float = 0.0
  baseline_upload_bits: float = 0.0
  baseline_download_bits: float = 0.0
  client_rounds: int = 0
  rounds: int = 0
  extra_bits: dict[str, float] = dataclasses.field(default_factory=dict)
  skipped_client_rounds: int = 0

  #: :meth:`state_dict` keys that checkpoints before skip counting lack.
  ADDED_STATE_KEYS = ('skipped_client_rounds',)

  def __post_init__(self):
    if self.num_params <= 0:
      raise ValueError(f'num_params must be > 0, got {self.num_params}.')
    self._csv: Optional[TextIO] = None
    self._skipped_by_round: dict[int, int] = {}

  @property
  def baseline_bits_per_client(self) -> float:
    """Uncompressed FedAvg bits per client per direction: 32 x params."""
    return float(FLOAT_BITS * self.num_params)

  def attach_csv(self, stream: TextIO) -> None:
    """Streams rows round,client_id,upload_bits,download_bits to ``stream``."""
    self._csv = stream
    if stream.tell() == 0:
      stream.write('round,client_id,upload_bits,download_bits\n')

  def record_round(self, round_num: int,
                   client_bits: Mapping[Any, Mapping[str, float]]) -> dict:
    """Adds one round.

    Args:
      round_num: the round's number (the runner: 1 for the first round).
      client_bits: ``{client_id: {'upload_bits': u, 'download_bits': d}}``,
        optionally ``'skipped': bool`` (e.g. client diagnostics).

    Returns:
      This round's totals: upload_bits, download_bits, num_clients,
      skipped_clients.

    Raises:
      ValueError: for a missing, negative or non-finite bit count.
    """
    round_up = round_down = 0.0
    skipped = 0
    for cid, d in client_bits.items():
      try:
        up, down = float(d['upload_bits']), float(d['download_bits'])
      except KeyError as e:
        raise ValueError(
            f'Client {cid!r} in round {round_num} reports no {e.args[0]}; '
            'every algorithm must report upload_bits and download_bits.'
        ) from None
      for name, v in (('upload_bits', up), ('download_bits', down)):
        if not math.isfinite(v) or v < 0:
          raise ValueError(
              f'Client {cid!r} in round {round_num}: {name}={v}; must be a '
              'finite number >= 0.')
      round_up += up
      round_down += down
      skipped += int(bool(d.get('skipped', False)))
      for key in self.extra_bits:
        self.extra_bits[key] += float(d.get(key, 0.0))
      if self._csv is not None:
        cid_str = cid.decode(errors='replace') if isinstance(cid, bytes) else cid
        self._csv.write(f'{round_num},{cid_str},{up:.17g},{down:.17g}\n')
    n = len(client_bits)
    self.upload_bits += round_up
    self.download_bits += round_down
    self.baseline_upload_bits += (n - skipped) * self.baseline_bits_per_client
    self.baseline_download_bits += n * self.baseline_bits_per_client
    self.client_rounds += n
    self.skipped_client_rounds += skipped
    self._skipped_by_round[int(round_num)] = skipped
    self.rounds += 1
    if self._csv is not None:
      self._csv.flush()
    return {'upload_bits': round_up, 'download_bits': round_down,
            'num_clients': n, 'skipped_clients': skipped}

  def skipped_clients(self, round_num: int) -> int:
    """Clients skipped in ``round_num`` (recorded since creation or restore).

    Raises:
      KeyError: ``round_num`` was not recorded by this object.
    """
    try:
      return self._skipped_by_round[int(round_num)]
    except KeyError:
      raise KeyError(
          f'Round {round_num} was not recorded by this ledger (recorded: '
          f'{sorted(self._skipped_by_round) or "none"}).') from None

  def summary(self) -> dict[str, float]:
    """Totals in bytes and ratios against uncompressed FedAvg.

    Keys: total_upload_bytes, total_download_bytes, baseline_upload_bytes,
    baseline_download_bytes, upload_compression, download_compression,
    total_compression, num_params, client_rounds, rounds,
    skipped_client_rounds. Ratios are NaN before the first round.
    """
    def ratio(base, actual):
      if actual > 0:
        return base / actual
      return math.inf if base > 0 else math.nan
    up = ratio(self.baseline_upload_bits, self.upload_bits)
    down = ratio(self.baseline_download_bits, self.download_bits)
    if math.isnan(up) or math.isnan(down):
      total = math.nan
    else:
      total = total_compression(up, down)
    return {
        'total_upload_bytes': self.upload_bits / BITS_PER_BYTE,
        'total_download_bytes': self.download_bits / BITS_PER_BYTE,
        'baseline_upload_bytes': self.baseline_upload_bits / BITS_PER_BYTE,
        'baseline_download_bytes': self.baseline_download_bits / BITS_PER_BYTE,
        'upload_compression': up,
        'download_compression': down,
        'total_compression': total,
        'num_params': self.num_params,
        'client_rounds': self.client_rounds,
        'rounds': self.rounds,
        'skipped_client_rounds': self.skipped_client_rounds,
    }

  def state_dict(self) -> dict[str, Any]:
    """Plain state for checkpoints."""
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    out['extra_bits'] = dict(self.extra_bits)
    return out

  def legacy_state_dict(self) -> dict[str, Any]:
    """:meth:`state_dict` without :data:`ADDED_STATE_KEYS` (old checkpoints)."""
    return {k: v for k, v in self.state_dict().items()
            if k not in self.ADDED_STATE_KEYS}

  @classmethod
  def from_state_dict(cls, state: Mapping[str, Any]) -> 'CommLedger':
    """Inverse of :meth:`state_dict` (missing keys take their defaults)."""
    return cls(**{f.name: (dict(state[f.name]) if f.name == 'extra_bits'
                           else state[f.name])
                  for f in dataclasses.fields(cls) if f.name in state})
