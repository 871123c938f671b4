"""curves.png and plot_runs: the drawn data are the runs' metrics.jsonl."""

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from fedlite_jax.training import ConfigError
from fedlite_jax.training import RunConfig
from fedlite_jax.training import outputs
from fedlite_jax.training import plots
from fedlite_jax.training import round_metrics
from fedlite_jax.training import run

ROOT = pathlib.Path(__file__).resolve().parent.parent
PNG = b'\x89PNG\r\n\x1a\n'
UPLOAD = 'uniform_quantization:8'


@pytest.fixture(scope='module')
def run_dirs(tmp_path_factory):
  """Two 2-round runs: uncompressed and 8-bit uploads."""
  base = tmp_path_factory.mktemp('runs')
  dirs = []
  for name, options in (('plain', {}), ('q8', {'upload': UPLOAD})):
    run(RunConfig(task='embedded_mnist', num_clients=12, clients_per_round=3,
                  client_batch_size=32, num_rounds=2, eval_every=1,
                  progress=False, seed=3, options=options,
                  output_dir=str(base / name)))
    dirs.append(base / name)
  return dirs


def _evals(run_dir):
  return round_metrics.evaluations(
      outputs.read_metrics(run_dir / 'metrics.jsonl'))


def test_plot_runs_draws_each_runs_metrics(run_dirs, tmp_path):
  out = tmp_path / 'sub' / 'overlay.png'
  fig = plots.plot_runs(run_dirs, out)
  assert out.read_bytes()[:8] == PNG
  by_round, by_mb = fig.axes
  for ax in (by_round, by_mb):
    assert len(ax.get_lines()) == 2
  for line_r, line_mb, run_dir in zip(by_round.get_lines(),
                                      by_mb.get_lines(), run_dirs):
    evals = _evals(run_dir)
    assert [r['round'] for r in evals] == [1, 2]
    acc = [r['eval/accuracy'] for r in evals]
    np.testing.assert_array_equal(line_r.get_xdata(), [1, 2])
    np.testing.assert_array_equal(line_r.get_ydata(), acc)
    np.testing.assert_allclose(
        line_mb.get_xdata(),
        [r['comm/upload_bytes_total'] / 1e6 for r in evals])
    np.testing.assert_array_equal(line_mb.get_ydata(), acc)
  # 8-bit uploads send about a quarter of float32's bytes.
  plain, q8 = (line.get_xdata()[-1] for line in by_mb.get_lines())
  assert 0.2 < q8 / plain < 0.3
  legend = [t.get_text() for t in by_mb.get_legend().get_texts()]
  assert 'upload uncompressed' in legend[0] and f'upload {UPLOAD}' in legend[1]
  assert all('fedavg' in t and '(seed 3)' in t for t in legend)
  assert by_mb.get_xlabel() == 'cumulative upload (MB)'


def test_plot_runs_labels_and_metric(run_dirs, tmp_path):
  fig = plots.plot_runs(run_dirs, tmp_path / 'o.png', metric='loss',
                        labels=['a', 'b'])
  assert [t.get_text() for t in fig.axes[1].get_legend().get_texts()] == [
      'a', 'b']
  np.testing.assert_array_equal(
      fig.axes[0].get_lines()[1].get_ydata(),
      [r['eval/loss'] for r in _evals(run_dirs[1])])


@pytest.mark.parametrize('kwargs,match', [
    ({'metric': 'bleu'}, r'--metric=bleu: .* has no eval/bleu \(it has: '
                         r'accuracy, loss\)'),
    ({'labels': ['a']}, r'--labels: 1 labels for 2 runs'),
])
def test_plot_runs_bad_input_writes_nothing(run_dirs, tmp_path, kwargs, match):
  with pytest.raises(ConfigError, match=match):
    plots.plot_runs(run_dirs, tmp_path / 'o.png', **kwargs)
  assert not (tmp_path / 'o.png').exists()


def test_binary_names_missing_folder(run_dirs, tmp_path):
  missing = tmp_path / 'nope'
  proc = subprocess.run(
      [sys.executable, str(ROOT / 'experiments' / 'plot_runs.py'),
       str(run_dirs[0]), str(missing), f'--output={tmp_path / "o.png"}'],
      capture_output=True, text=True, check=False)
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines()[-1] == (
      f'plot_runs.py: error: {missing}: no metrics.jsonl (not a run folder)')
  assert not (tmp_path / 'o.png').exists()


def test_curves_png_integer_round_ticks_and_mb(run_dirs, tmp_path):
  rows = outputs.read_metrics(run_dirs[1] / 'metrics.jsonl')
  config = RunConfig(task='embedded_mnist', seed=3, options={'upload': UPLOAD})
  fig = plots.plot_curves(tmp_path, rows, 'accuracy', plots.run_title(config))
  assert (tmp_path / 'curves.png').read_bytes()[:8] == PNG
  assert (run_dirs[1] / 'curves.png').read_bytes()[:8] == PNG
  assert f'upload {UPLOAD}' in fig.texts[0].get_text()  # the suptitle
  loss_ax, round_ax, mb_ax = fig.axes
  for ax in (loss_ax, round_ax):
    lo, hi = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
    assert ticks and all(float(t).is_integer() for t in ticks), ticks
  np.testing.assert_allclose(
      mb_ax.get_lines()[0].get_xdata(),
      [r['comm/upload_bytes_total'] / 1e6 for r in round_metrics.evaluations(
          rows)])
