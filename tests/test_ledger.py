"""Communication ledger: FedAvg baseline, ratios, and the IGC Table 2 formula."""

import io
import math

import pytest

from fedlite_jax.comm import CommLedger
from fedlite_jax.comm import total_compression


def test_fedavg_is_32_bits_per_param_each_way():
  n = 1_206_590  # EMNIST CNN
  ledger = CommLedger(n)
  bits = 32.0 * n
  for r in range(3):
    ledger.record_round(r, {f'c{i}': {'upload_bits': bits, 'download_bits': bits}
                            for i in range(10)})
  s = ledger.summary()
  assert s['total_upload_bytes'] == 3 * 10 * 4 * n
  assert s['total_download_bytes'] == 3 * 10 * 4 * n
  assert s['upload_compression'] == s['download_compression'] == 1.0
  assert s['total_compression'] == 1.0
  assert s['client_rounds'] == 30 and s['rounds'] == 3


def test_compression_ratios_and_table2_total():
  # IGC paper Table 2: D = 124,439,808, d = 16,384, K = 8: up D/d = 7,595x,
  # down D/(dK) = 949x, total 2/(1/up + 1/down) = 1,688x.
  big_d, d, k = 124_439_808, 16_384, 8
  ledger = CommLedger(big_d)
  ledger.record_round(0, {'a': {'upload_bits': 32.0 * d,
                                'download_bits': 32.0 * d * k}})
  s = ledger.summary()
  assert round(s['upload_compression']) == 7595
  assert round(s['download_compression']) == 949
  assert round(s['total_compression']) == 1688
  assert total_compression(7595, 949) == pytest.approx(1687.0, abs=1)
  # Equals baseline total / actual total because the baseline is symmetric.
  assert s['total_compression'] == pytest.approx(
      (s['baseline_upload_bytes'] + s['baseline_download_bytes']) /
      (s['total_upload_bytes'] + s['total_download_bytes']))


def test_csv_rows_and_state_roundtrip():
  ledger = CommLedger(10)
  buf = io.StringIO()
  ledger.attach_csv(buf)
  ledger.record_round(4, {b'x': {'upload_bits': 1, 'download_bits': 2}})
  assert buf.getvalue().splitlines() == [
      'round,client_id,upload_bits,download_bits', '4,x,1,2']
  again = CommLedger.from_state_dict(ledger.state_dict())
  assert again.summary() == ledger.summary()


def test_bad_bits_are_rejected():
  ledger = CommLedger(10)
  with pytest.raises(ValueError, match='upload_bits'):
    ledger.record_round(0, {'a': {'download_bits': 1}})
  with pytest.raises(ValueError, match='nan'):
    ledger.record_round(0, {'a': {'upload_bits': math.nan, 'download_bits': 1}})
  with pytest.raises(ValueError, match='num_params'):
    CommLedger(0)
  assert math.isnan(CommLedger(3).summary()['upload_compression'])


def test_skipped_clients_are_counted_per_round_and_in_total():
  ledger = CommLedger(10)
  full = {'upload_bits': 320.0, 'download_bits': 320.0}
  skipped = {'upload_bits': 0.0, 'download_bits': 320.0, 'skipped': True}
  assert ledger.record_round(0, {b'a': full, b'b': full})[
      'skipped_clients'] == 0
  assert ledger.record_round(1, {b'a': full, b'b': skipped,
                                 b'c': dict(skipped)})['skipped_clients'] == 2
  assert ledger.skipped_clients(0) == 0 and ledger.skipped_clients(1) == 2
  with pytest.raises(KeyError, match='Round 2 was not recorded'):
    ledger.skipped_clients(2)
  s = ledger.summary()
  assert s['skipped_client_rounds'] == 2 and s['client_rounds'] == 5
  # A skipped client sends nothing, uncompressed or not: the baseline
  # uploads of the 3 kept client-rounds only, the downloads of all 5.
  assert s['baseline_upload_bytes'] == 3 * 40
  assert s['baseline_download_bytes'] == 5 * 40
  assert s['upload_compression'] == s['download_compression'] == 1.0
  again = CommLedger.from_state_dict(ledger.state_dict())
  assert again.summary() == s


def test_checkpoints_from_before_skip_counting_restore(tmp_path):
  from fedlite_jax.training import state_io  # pylint: disable=g-import-not-at-top
  old = CommLedger(10)
  old.record_round(0, {b'a': {'upload_bits': 3.0, 'download_bits': 4.0}})
  legacy = old.legacy_state_dict()
  assert set(legacy) == set(old.state_dict()) - {'skipped_client_rounds'}
  state_io.save_checkpoint(tmp_path, 1, {'ledger': legacy}, {})
  path = state_io.latest_checkpoint(tmp_path)
  with pytest.raises(state_io.CheckpointError, match='state structure'):
    state_io.restore_checkpoint(
        path, {'ledger': CommLedger(10).state_dict()}, {})
  _, restored = state_io.restore_checkpoint(
      path, {'ledger': CommLedger(10).legacy_state_dict()}, {})
  ledger = CommLedger.from_state_dict(restored['ledger'])
  assert ledger.skipped_client_rounds == 0
  assert ledger.summary()['total_upload_bytes'] == 3.0 / 8
