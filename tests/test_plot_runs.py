"""curves.png and plot_runs: the drawn data are the runs' metrics.jsonl;
titles name the task, labels the compression both ways and DP's epsilon;
legends inside the figure, off the axes; integer round ticks; png, pdf,
svg."""

import json
import pathlib
import shutil
import subprocess
import sys

from matplotlib.backends.backend_agg import FigureCanvasAgg
import numpy as np
import pytest

from fedlite_jax.training import ConfigError
from fedlite_jax.training import RunConfig
from fedlite_jax.training import outputs
from fedlite_jax.training import plots
from fedlite_jax.training import round_metrics
from fedlite_jax.training import run
from fedlite_jax.training.evaluation import TrainingFailedError

ROOT = pathlib.Path(__file__).resolve().parent.parent
PNG = b'\x89PNG\r\n\x1a\n'
UPLOAD = 'uniform_quantization:8'
DOWNLOAD = 'uniform_quantization:6'


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


def _legend_texts(fig):
  """The figure legend's labels, wrapped lines joined again."""
  (legend,) = fig.legends
  return [' '.join(t.get_text().split()) for t in legend.get_texts()]


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
  legend = _legend_texts(fig)
  assert legend[0] == 'fedavg; no compression; seed 3'
  assert f'upload {UPLOAD}, download uncompressed' in legend[1]
  assert all(t.startswith('fedavg; ') and t.endswith('; seed 3')
             for t in legend)
  assert by_mb.get_xlabel() == 'cumulative upload (MB)'


def test_plot_runs_labels_and_metric(run_dirs, tmp_path):
  fig = plots.plot_runs(run_dirs, tmp_path / 'o.png', metric='loss',
                        labels=['a', 'b'])
  assert _legend_texts(fig) == ['a', 'b']
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


@pytest.fixture(scope='module')
def dp_run(tmp_path_factory):
  """A 2-round DP-FedAvg run with compression both ways (its noise makes
  the model no better than chance: the outputs are written all the same)."""
  out = tmp_path_factory.mktemp('dp') / 'dp'
  try:
    run(RunConfig(task='embedded_mnist', num_clients=12, clients_per_round=3,
                  client_batch_size=32, num_rounds=2, eval_every=1,
                  progress=False, seed=3, output_dir=str(out),
                  options={'upload': UPLOAD, 'download': DOWNLOAD,
                           'dp_clip': 1.0, 'dp_noise_multiplier': 0.5}))
  except TrainingFailedError:
    pass
  return out


def _binary(*args):
  return subprocess.run(
      [sys.executable, str(ROOT / 'experiments' / 'plot_runs.py'),
       *map(str, args)], capture_output=True, text=True, check=False)


def _fake_run(folder, rounds, eval_rounds):
  """A run folder of metrics.jsonl only: training loss each round, test
  accuracy at ``eval_rounds``, 1 MB uploaded per round."""
  folder.mkdir(parents=True)
  rows = [{'round': r, 'train/loss': 2.0 / r,
           'comm/upload_bytes_total': 1e6 * r,
           **({'eval/accuracy': 0.1 * r, 'eval/loss': 1.0 / r}
              if r in eval_rounds else {})} for r in range(1, rounds + 1)]
  (folder / 'metrics.jsonl').write_text(
      ''.join(json.dumps(r) + '\n' for r in rows))
  return folder, rows


def _of_task(run_dir, folder, task):
  """A copy of ``run_dir`` whose summary.json says ``task``."""
  shutil.copytree(run_dir, folder)
  summary = json.loads((folder / 'summary.json').read_text())
  (folder / 'summary.json').write_text(json.dumps({**summary, 'task': task}))
  return folder


def _integer_ticks(ax):
  lo, hi = ax.get_xlim()
  ticks = [float(t) for t in ax.get_xticks() if lo <= t <= hi]
  assert ticks and all(t.is_integer() for t in ticks), ticks
  return ticks


def test_plot_runs_legend_inside_figure_and_off_the_axes(run_dirs, tmp_path):
  long = ['fedavg with a long description of its settings; ' * 4,
          'x' * 200]
  for labels in (None, long):
    out = tmp_path / 'legend.png'
    fig = plots.plot_runs(run_dirs, out, labels=labels)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    legends = fig.legends + [ax.get_legend() for ax in fig.axes
                             if ax.get_legend() is not None]
    assert legends
    for legend in legends:
      box = legend.get_window_extent(renderer)
      assert (fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and
              fig.bbox.y0 <= box.y0 and box.y1 <= fig.bbox.y1), (box,
                                                                 fig.bbox)
      for ax in fig.axes:  # never over the data
        assert not box.overlaps(ax.bbox), (box, ax.bbox)
    # The saved image holds the whole figure (bbox_inches='tight' only
    # trims its margins).
    tight = fig.get_tightbbox(renderer)
    assert tight.x0 >= 0 and tight.x1 <= fig.get_figwidth()
    assert tight.y0 >= 0 and tight.y1 <= fig.get_figheight()
    assert out.read_bytes()[:8] == PNG


def test_titles_name_the_task(run_dirs, tmp_path):
  fig = plots.plot_runs(run_dirs, tmp_path / 'o.png')
  assert fig.get_suptitle().startswith('embedded_mnist: test accuracy vs '
                                       'round')
  rows = outputs.read_metrics(run_dirs[0] / 'metrics.jsonl')
  config = RunConfig(task='embedded_mnist', algorithm='fedavg', seed=3)
  title = plots.run_title(config)
  assert title == 'embedded_mnist: fedavg (seed 3)\nno compression'
  fig = plots.plot_curves(tmp_path, rows, 'accuracy', title)
  assert fig.get_suptitle() == title


def test_mixed_tasks_refused_in_one_line(run_dirs, tmp_path):
  other = _of_task(run_dirs[1], tmp_path / 'emnist_run', 'emnist')
  out = tmp_path / 'o.png'
  with pytest.raises(ConfigError, match=(
      rf'^runs of different tasks: {run_dirs[0]} is embedded_mnist, {other} '
      r'is emnist; plot one task at a time \(or pass --allow_mixed_tasks\)'
      r'\.$')):
    plots.plot_runs([run_dirs[0], other], out)
  proc = _binary(run_dirs[0], other, f'--output={out}')
  assert proc.returncode == 2
  assert len(proc.stderr.strip().splitlines()) == 1
  assert proc.stderr.startswith('plot_runs.py: error: runs of different '
                                'tasks: ')
  assert not out.exists()
  proc = _binary(run_dirs[0], other, f'--output={out}', '--allow_mixed_tasks')
  assert proc.returncode == 0, proc.stderr
  assert proc.stderr.strip().splitlines()[-1] == (
      f'plot_runs.py: warning: runs of different tasks: {run_dirs[0]} is '
      f'embedded_mnist, {other} is emnist (overlaid: --allow_mixed_tasks).')
  assert out.read_bytes()[:8] == PNG
  with pytest.warns(plots.MixedTasksWarning):
    fig = plots.plot_runs([run_dirs[0], other], out, allow_mixed_tasks=True)
  assert fig.get_suptitle().startswith('embedded_mnist + emnist: ')
  labels = _legend_texts(fig)
  assert labels[0].startswith('embedded_mnist: fedavg; ')
  assert labels[1].startswith('emnist: fedavg; ')


@pytest.mark.parametrize('name,fmt,magic', [
    ('o.pdf', None, (b'%PDF',)), ('o.svg', None, (b'<?xml', b'<svg')),
    ('o', 'svg', (b'<?xml', b'<svg')), ('o', None, (PNG,))])
def test_plot_runs_formats(run_dirs, tmp_path, name, fmt, magic):
  plots.plot_runs(run_dirs, tmp_path / name, format=fmt)
  assert (tmp_path / name).read_bytes().startswith(magic)


def test_curves_formats(run_dirs, tmp_path):
  rows = outputs.read_metrics(run_dirs[0] / 'metrics.jsonl')
  plots.plot_curves(tmp_path, rows, 'accuracy', 't', format='pdf')
  assert (tmp_path / 'curves.pdf').read_bytes().startswith(b'%PDF')
  plots.plot_curves(tmp_path, rows, 'accuracy', 't', format='svg')
  assert (tmp_path / 'curves.svg').read_bytes().startswith((b'<?xml',
                                                            b'<svg'))
  with pytest.raises(ConfigError, match=r'^--plot_format=jpg: unknown '
                     r'format; use one of png, pdf, svg\.$'):
    plots.plot_curves(tmp_path, rows, 'accuracy', 't', format='jpg')


@pytest.mark.parametrize('args,line', [
    (['--output={out}/o.png', '--format=jpg'],
     '--format=jpg: unknown format; use one of png, pdf, svg.'),
    (['--output={out}/o.jpg'],
     '{out}/o.jpg: unknown format .jpg; use one of png, pdf, svg (or '
     '--format).'),
    (['--output={out}/o.png', '--format=pdf'],
     '--format=pdf but {out}/o.png ends in .png; make them agree.'),
])
def test_binary_bad_format_one_line(run_dirs, tmp_path, args, line):
  proc = _binary(run_dirs[0], *(a.format(out=tmp_path) for a in args))
  assert proc.returncode == 2
  assert proc.stderr.strip().splitlines() == [
      'plot_runs.py: error: ' + line.format(out=tmp_path)]
  assert not list(tmp_path.iterdir())


def test_five_rounds_evaluated_once_integer_ticks(tmp_path):
  folder, rows = _fake_run(tmp_path / 'five', 5, eval_rounds={5})
  fig = plots.plot_curves(tmp_path, rows, 'accuracy', 'five rounds')
  loss_ax, round_ax, _ = fig.axes
  assert _integer_ticks(loss_ax) == [1, 2, 3, 4, 5]
  assert 5 in _integer_ticks(round_ax)
  np.testing.assert_array_equal(round_ax.get_lines()[0].get_xdata(), [5])
  fig = plots.plot_runs([folder], tmp_path / 'o.png')
  assert _integer_ticks(fig.axes[0]) == [5]
  assert _legend_texts(fig) == ['five']  # no summary.json: the folder name


def test_dp_run_label_names_epsilon_and_both_directions(dp_run, tmp_path):
  summary = json.loads((dp_run / 'summary.json').read_text())
  epsilon = summary['privacy']['epsilon']
  assert summary['privacy']['delta'] == 1e-6 and 0 < epsilon < np.inf
  eps = f'{epsilon:.3g}'
  expected = (f'fedavg; upload {UPLOAD}, download {DOWNLOAD}; DP eps={eps} '
              '(delta 1e-6); seed 3')
  assert plots.run_label(summary) == expected
  fig = plots.plot_runs([dp_run], tmp_path / 'o.png')
  assert _legend_texts(fig) == [expected]
  # A run without summary.json yet: run.json and the rows' epsilon.
  unfinished = shutil.copytree(dp_run, tmp_path / 'unfinished')
  (unfinished / 'summary.json').unlink()
  fig = plots.plot_runs([unfinished], tmp_path / 'o.png')
  assert _legend_texts(fig) == [expected]
  # curves.png's title, as the runner makes it: the rows' epsilon.
  config = RunConfig(**{**summary['flags'], 'output_dir': None})
  title = plots.run_title(config)
  assert title.endswith(f'DP {plots.EPSILON_PENDING} (delta 1e-6)')
  rows = outputs.read_metrics(dp_run / 'metrics.jsonl')
  fig = plots.plot_curves(tmp_path, rows, 'accuracy', title)
  assert fig.get_suptitle() == (
      f'embedded_mnist: fedavg (seed 3)\nupload {UPLOAD}, download '
      f'{DOWNLOAD}; DP eps={eps} (delta 1e-6)')
  assert plots.run_title(config, epsilon) == fig.get_suptitle()
