"""Regression pins: every runner algorithm, 2 rounds on real FEMNIST.

Refactors of the algorithms, transforms and round engines must keep each
algorithm's PRNG streams, arithmetic and bit accounting: the final test loss
and the total upload/download bytes of a short run are pinned in
``tests/golden/runner_femnist_2rounds.json`` (recorded before the refactor).
Bytes must match exactly; the loss to float rounding (rtol 1e-5).

Re-record (only when a change is meant to alter a number, and say why in the
commit): ``FEDLITE_DATA_DIR=... python tests/test_regression_runner.py --write [CASE ...]``.
"""

from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest

GOLDEN = pathlib.Path(__file__).parent / 'golden' / 'runner_femnist_2rounds.json'

BASE = dict(task='emnist', num_rounds=2, clients_per_round=3,
            client_batch_size=20, max_examples_per_client=60,
            eval_num_clients=4, eval_every=1, checkpoint_every=0,
            progress=False, seed=0)

# name -> (RunConfig overrides, algorithm options)
CASES = {
    'fedavg': (dict(algorithm='fedavg'), {}),
    'fedadam': (dict(algorithm='fedavg', server_optimizer='adam',
                     server_lr=0.01), {}),
    'fedprox': (dict(algorithm='fedprox'), {'fedprox_mu': 0.1}),
    'mime_lite': (dict(algorithm='mime_lite', client_lr=0.05), {}),
    'sgd_local_steps': (dict(algorithm='sgd'), {'local_steps': 2}),
    'topk': (dict(algorithm='topk'),
             {'upload': 'top_k:5000', 'local_steps': 2}),
    'fetchsgd': (dict(algorithm='fetchsgd'),
                 {'sketch_cols': 20000, 'topk_k': 5000}),
    'igc_static': (dict(algorithm='igc_static', client_lr=0.3),
                   {'intrinsic_dim': 1024}),
    'igc_k_subspace': (dict(algorithm='igc_k_subspace', client_lr=0.3),
                       {'intrinsic_dim': 1024, 'num_subspaces': 3}),
    'igc_time_varying': (dict(algorithm='igc_time_varying', client_lr=0.3),
                         {'intrinsic_dim': 1024, 'igc_rounds_per_epoch': 1}),
    'igc_k_subspace_time_varying': (
        dict(algorithm='igc_k_subspace_time_varying', client_lr=0.3),
        {'intrinsic_dim': 1024, 'num_subspaces': 3,
         'igc_rounds_per_epoch': 1}),
    'splitfed': (dict(algorithm='splitfed', client_lr=0.0316), {}),
    'fedlite': (dict(algorithm='fedlite', client_lr=0.0316),
                {'num_subvectors': 1152, 'num_groups': 1, 'num_centroids': 2,
                 'correction_lambda': 5e-5, 'fedlite_kmeans_iters': 5}),
    'fedavg_up8_down16_pvt40': (
        dict(algorithm='fedavg'),
        {'upload': 'uniform_quantization:8',
         'download': 'uniform_quantization:16', 'pvt_fraction': 0.4}),
}


#: Every case also runs on the vmap engine, on 2 lanes (the cohort of 3 is
#: not a multiple) and 4 steps per segment (clients starting and ending
#: inside a segment; the last segment running only the planned steps),
#: against the same records; split learning has no round engine and runs
#: its clients vmapped, 2 per call, instead of unrolled.
VMAP_CASES = tuple(sorted(CASES))

#: Relative loss tolerance of a vmap case against the loop engine (1e-5
#: unless listed). Stochastic rounding: 2 lanes sum in another order than the
#: loop and flip roundings (3.418634 on 2 lanes against 3.420118 in the loop
#: engine, at 1 and 4 steps per segment alike).
VMAP_RTOL = {'fedavg_up8_down16_pvt40': 1e-3}

#: Cases whose vmap run is compared with the loop engine on the vmap
#: engine's convolutions (im2col) instead of the record (lax): FedAdam's
#: normalized update amplifies the float difference of the two.
IM2COL_REFERENCE = ('fedadam',)


def run_case(name: str, data_dir: str, output_dir: str,
             vmap: bool = False, segment_steps: int = 4,
             conv_implementation: str = 'auto') -> dict:
  """Runs one case; returns {'loss', 'upload_bytes', 'download_bytes'}."""
  from fedlite_jax.training import RunConfig  # pylint: disable=g-import-not-at-top
  from fedlite_jax.training import run  # pylint: disable=g-import-not-at-top
  overrides, options = CASES[name]
  if vmap and overrides['algorithm'] in ('splitfed', 'fedlite'):
    options = {**options, 'split_client_execution': 'vmap'}
    overrides = {**overrides, 'lanes_per_device': 2}
  elif vmap:
    overrides = {**overrides, 'round_engine': 'vmap', 'lanes_per_device': 2,
                 'segment_steps': segment_steps}
  overrides = {**overrides, 'conv_implementation': conv_implementation}
  summary = run(RunConfig(**{**BASE, **overrides}, data_dir=data_dir,
                          output_dir=output_dir, options=options))
  comm = summary['communication']
  return {'loss': float(summary['final_eval']['loss']),
          'upload_bytes': float(comm['total_upload_bytes']),
          'download_bytes': float(comm['total_download_bytes'])}


def _check_training_rows(output_dir: pathlib.Path) -> None:
  """One row per round, each with a finite client training loss."""
  from fedlite_jax.training import outputs  # pylint: disable=g-import-not-at-top
  rows = outputs.read_metrics(output_dir / 'metrics.jsonl')
  assert [r['round'] for r in rows] == [1, 2]
  assert all(math.isfinite(r['train/loss']) for r in rows), rows


@pytest.mark.parametrize('name', sorted(CASES))
def test_runner_matches_recorded_baseline(name, data_dir, tmp_path):
  if not (data_dir / 'femnist105').is_dir():
    pytest.skip('needs femnist105/ under FEDLITE_DATA_DIR')
  golden = json.loads(GOLDEN.read_text())[name]
  got = run_case(name, str(data_dir), str(tmp_path / name))
  assert got['upload_bytes'] == golden['upload_bytes']
  assert got['download_bytes'] == golden['download_bytes']
  assert got['loss'] == pytest.approx(golden['loss'], rel=1e-5)
  _check_training_rows(tmp_path / name)


@pytest.mark.parametrize('name', VMAP_CASES)
def test_vmap_engine_on_lanes_matches_the_loop_engine(name, data_dir,
                                                      tmp_path):
  """The vmap engine (3 clients on 2 lanes, 4 steps per segment) gives the
  loop engine's loss (rel 1e-5 but :data:`VMAP_RTOL`) and bytes (exact):
  the recorded ones, or for :data:`IM2COL_REFERENCE` a loop run on im2col
  convolutions."""
  if not (data_dir / 'femnist105').is_dir():
    pytest.skip('needs femnist105/ under FEDLITE_DATA_DIR')
  want = json.loads(GOLDEN.read_text())[name]
  if name in IM2COL_REFERENCE:
    want = run_case(name, str(data_dir), str(tmp_path / 'loop'),
                    conv_implementation='im2col')
  got = run_case(name, str(data_dir), str(tmp_path / name), vmap=True)
  assert got['upload_bytes'] == want['upload_bytes']
  assert got['download_bytes'] == want['download_bytes']
  assert got['loss'] == pytest.approx(want['loss'],
                                      rel=VMAP_RTOL.get(name, 1e-5))
  _check_training_rows(tmp_path / name)


#: (case, engine) pairs of the compile test: the FedOpt server step with an
#: optimizer state (fedadam), two client passes (mime_lite), a new IGC epoch
#: every round (igc_k_subspace_time_varying), 'changed' download accounting
#: (fetchsgd), quantized download + PVT.
COMPILE_CASES = (('fedadam', 'loop'), ('mime_lite', 'loop'),
                 ('igc_k_subspace_time_varying', 'loop'),
                 ('fetchsgd', 'vmap'), ('fedavg_up8_down16_pvt40', 'vmap'),
                 ('fedadam', 'vmap'))


@pytest.mark.parametrize('name,engine', COMPILE_CASES)
def test_rounds_after_the_first_compile_nothing(name, engine, data_dir,
                                                tmp_path, monkeypatch):
  """3 rounds on fresh cohorts, evaluated every round: round 1 compiles the
  client program (the counter counts), rounds 2 and 3 compile no program at
  all (JAX's compile events: server update, download, accounting,
  evaluation, client program). Counts are per-round metrics rows."""
  if not (data_dir / 'femnist105').is_dir():
    pytest.skip('needs femnist105/ under FEDLITE_DATA_DIR')
  from fedlite_jax.training import outputs  # pylint: disable=g-import-not-at-top
  monkeypatch.setitem(BASE, 'num_rounds', 3)
  run_case(name, str(data_dir), str(tmp_path / name), vmap=engine == 'vmap')
  rows = outputs.read_metrics(tmp_path / name / 'metrics.jsonl')
  assert [r['round'] for r in rows] == [1, 2, 3]
  assert rows[0]['engine/client_program_compilations'] > 0, rows[0]
  assert rows[0]['engine/compilations'] > rows[0][
      'engine/client_program_compilations'], rows[0]
  assert all('eval/loss' in r for r in rows)  # Evaluated every round.
  assert [r['engine/compilations'] for r in rows[1:]] == [0, 0], [
      {k: v for k, v in r.items() if 'compil' in k} for r in rows]


def _write(names: list[str]) -> None:
  """Records ``names`` (all cases if empty), keeping the other records."""
  import os  # pylint: disable=g-import-not-at-top
  import tempfile  # pylint: disable=g-import-not-at-top
  import fedlite_jax  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  data_dir = os.environ['FEDLITE_DATA_DIR']
  out = json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}
  with tempfile.TemporaryDirectory() as tmp:
    for name in names or sorted(CASES):
      out[name] = run_case(name, data_dir, os.path.join(tmp, name))
      print(name, out[name], flush=True)
  GOLDEN.parent.mkdir(exist_ok=True)
  GOLDEN.write_text(json.dumps(out, indent=2, sort_keys=True) + '\n')


if __name__ == '__main__':
  if sys.argv[1:2] == ['--write']:
    _write(sys.argv[2:])
  else:
    sys.exit(f'usage: {sys.argv[0]} --write [CASE ...]')
