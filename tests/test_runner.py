"""The experiment runner: outputs, exact resume, clear errors."""

import json
import os
import subprocess
import sys
import textwrap

import fedjax
import jax
import numpy as np
import pytest

from fedlite_jax.training import state_io
from fedlite_jax.training import ConfigError
from fedlite_jax.training import RunConfig
from fedlite_jax.training import evaluation
from fedlite_jax.training import outputs
from fedlite_jax.training import run
from fedlite_jax.training import build as build_lib
from fedlite_jax.training import runner
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import tasks

SMALL = dict(task='embedded_mnist', num_clients=12, clients_per_round=3,
             client_batch_size=32, eval_every=2, progress=False, seed=3)


def _final_params(out_dir):
  path = state_io.latest_checkpoint(os.path.join(out_dir, 'checkpoints'))
  return state_io.read_leaves(path)[1]


def _evaluate_with_fedjax(out, config):
  """The test metrics of ``out``'s last checkpoint by FedJAX's own
  ``evaluate_model`` on the run's test batches (not the runner's code)."""
  task = tasks.get_task(config.task)
  config = config_lib.resolve(config, task.defaults)
  _, test_fd, info = task.load_data(config)
  model = task.build_model(config, info).model
  init = state_io.load_init_params(
      state_io.latest_checkpoint(out / 'checkpoints'),
      model.init(jax.random.PRNGKey(0)))
  batches = evaluation.eval_batches(test_fd, config.eval_batch_size,
                                    config.eval_num_clients, config.seed)
  return {k: float(v) for k, v in
          fedjax.evaluate_model(model, init.params, batches).items()}


def test_outputs_and_summary(tmp_path):
  out = tmp_path / 'run'
  config = RunConfig(num_rounds=4, output_dir=str(out), **SMALL)
  summary = run(config)
  for name in ('metrics.jsonl', 'summary.json', 'communication.csv',
               'curves.png'):
    assert (out / name).exists(), name
  assert list((out / 'tb').iterdir())
  rows = outputs.read_metrics(out / 'metrics.jsonl')
  # One row per round; evaluations every 2 rounds.
  assert [r['round'] for r in rows] == [1, 2, 3, 4]
  assert [r['round'] for r in rows if 'eval/accuracy' in r] == [2, 4]
  assert 'eval/loss' not in rows[0] and 'train/loss' in rows[0]
  assert 'time/eval_seconds' in rows[1] and 'time/eval_seconds' not in rows[0]
  saved = json.loads((out / 'summary.json').read_text())
  assert saved['final_eval'] == summary['final_eval']
  # The final evaluation is the final model's, recomputed by FedJAX.
  want = _evaluate_with_fedjax(out, config)
  assert saved['final_eval']['accuracy'] == pytest.approx(want['accuracy'],
                                                          abs=1e-6)
  assert saved['final_eval']['loss'] == pytest.approx(want['loss'], rel=1e-5)
  assert rows[-1]['eval/accuracy'] == saved['final_eval']['accuracy']
  comm = saved['communication']
  n = 1_199_882  # EMNIST CNN with 10 classes: 18,816 + 9216*128+128 + 128*10+10
  assert comm['num_params'] == n
  # FedAvg: 32 bits x params each way, 3 clients x 4 rounds.
  assert comm['total_upload_bytes'] == comm['total_download_bytes'] == 4 * n * 12
  for r in rows:
    assert r['train/clients'] == 3 and r['train/skipped_clients'] == 0
    assert r['comm/upload_bytes'] == r['comm/download_bytes'] == 3 * n * 4
    assert r['comm/upload_bytes_total'] == r['round'] * 3 * n * 4
  for key in ('upload_compression', 'download_compression', 'total_compression'):
    assert comm[key] == 1.0
  assert saved['rounds'] == 4 and saved['stopped_early'] is None
  assert saved['seconds_per_round'] == pytest.approx(
      sum(r['time/train_seconds'] for r in rows) / 4)
  assert saved['engine']['useful_steps'] == sum(
      r['engine/useful_steps'] for r in rows)
  assert saved['flags']['seed'] == 3 and saved['synthetic_partition']
  assert saved['status'] == 'ok' and saved['failure'] is None
  assert len((out / 'communication.csv').read_text().splitlines()) == 1 + 12
  # The code version: the checkout's HEAD (None outside a git checkout).
  head = subprocess.run(['git', '-C', os.path.dirname(outputs.__file__),
                         'rev-parse', 'HEAD'], capture_output=True, text=True)
  expected = head.stdout.strip() if head.returncode == 0 else None
  assert saved['code']['commit'] == expected
  assert saved['started_with_code'] == saved['code']
  assert json.loads((out / 'run.json').read_text())['code'] == saved['code']


def test_killed_run_resumes_to_identical_parameters(tmp_path, monkeypatch):
  cfg = dict(num_rounds=6, checkpoint_every=2, **SMALL)
  run(RunConfig(output_dir=str(tmp_path / 'full'), **cfg))

  calls = {'n': 0}
  real_evaluate = evaluation.evaluate

  def crash_on_second_eval(*args, **kwargs):
    calls['n'] += 1
    if calls['n'] == 2:  # after round 4 trained, before its checkpoint
      raise KeyboardInterrupt('simulated kill')
    return real_evaluate(*args, **kwargs)

  monkeypatch.setattr(evaluation, 'evaluate', crash_on_second_eval)
  with pytest.raises(KeyboardInterrupt):
    run(RunConfig(output_dir=str(tmp_path / 'resumed'), **cfg))
  monkeypatch.setattr(evaluation, 'evaluate', real_evaluate)
  assert state_io.latest_checkpoint(tmp_path / 'resumed' / 'checkpoints').name \
      == '2'
  summary = run(RunConfig(output_dir=str(tmp_path / 'resumed'), **cfg))

  for a, b in zip(_final_params(tmp_path / 'full'),
                  _final_params(tmp_path / 'resumed')):
    np.testing.assert_array_equal(a, b)
  rows = outputs.read_metrics(tmp_path / 'resumed' / 'metrics.jsonl')
  assert [r['round'] for r in rows] == [1, 2, 3, 4, 5, 6]
  full = json.loads((tmp_path / 'full' / 'summary.json').read_text())
  assert summary['communication'] == full['communication']
  assert summary['final_eval'] == full['final_eval']
  # TensorBoard: one point per round and tag, the killed rounds purged.
  got, _ = outputs.read_tensorboard(tmp_path / 'resumed' / 'tb')
  want, _ = outputs.read_tensorboard(tmp_path / 'full' / 'tb')
  assert [s for s, _ in got['train/loss']] == [1, 2, 3, 4, 5, 6]
  assert got['train/loss'] == want['train/loss']
  assert got['eval/accuracy'] == want['eval/accuracy']


def test_mismatched_resume_and_foreign_output_dir(tmp_path):
  out = str(tmp_path / 'r')
  run(RunConfig(num_rounds=2, output_dir=out, **SMALL))
  with pytest.raises(state_io.CheckpointError, match='client_lr'):
    run(RunConfig(num_rounds=2, output_dir=out, client_lr=0.5, **SMALL))
  with pytest.raises(ConfigError, match='--overwrite'):
    run(RunConfig(num_rounds=2, output_dir=out, resume=False, **SMALL))
  # --overwrite replaces the other run's checkpoints and metrics.
  summary = run(RunConfig(num_rounds=2, output_dir=out, client_lr=0.5,
                          overwrite=True, **SMALL))
  assert summary['flags']['client_lr'] == 0.5
  latest = state_io.latest_checkpoint(os.path.join(out, 'checkpoints'))
  assert state_io.read_metadata(latest)['client_lr'] == 0.5
  assert [r['round'] for r in outputs.read_metrics(
      os.path.join(out, 'metrics.jsonl'))] == [1, 2]


def test_bad_config_values():
  with pytest.raises(ConfigError, match="--task='nope'"):
    run(RunConfig(task='nope'))
  with pytest.raises(ConfigError, match='--client_lr=-1'):
    run(RunConfig(client_lr=-1.0, **SMALL))
  with pytest.raises(ConfigError, match='exceeds'):
    run(RunConfig(**{**SMALL, 'clients_per_round': 99}))


def test_client_rng_depends_on_seed_round_client():
  keys = {tuple(np.asarray(runner.client_rng(s, r, c)))
          for s in (0, 1) for r in (0, 1) for c in (b'a', b'b')}
  assert len(keys) == 8
  np.testing.assert_array_equal(runner.client_rng(0, 1, b'a'),
                                runner.client_rng(0, 1, b'a'))
  # The documented derivation, computed eagerly (crc32 >= 2^31 included).
  import zlib  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  for seed, r, cid in ((0, 0, b'a'), (3, 17, b'\xff' * 5), (1, 5, b'f0001')):
    want = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), r),
                              zlib.crc32(cid))
    np.testing.assert_array_equal(runner.client_rng(seed, r, cid), want)


def test_evaluate_equals_fedjax_and_compiles_once():
  """evaluation.evaluate gives fedjax.evaluate_model's numbers exactly and,
  once compiled, runs no eager operation (no compile event)."""
  import fedjax  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  from fedlite_jax.models import emnist  # pylint: disable=g-import-not-at-top
  from fedlite_jax.rounds import stats  # pylint: disable=g-import-not-at-top
  model = emnist.create_emnist_cnn().model
  params = model.init(jax.random.PRNGKey(0))
  rng = np.random.RandomState(0)
  datasets = [fedjax.ClientDataset({
      'x': rng.rand(n, 28, 28, 1).astype(np.float32),
      'y': rng.randint(0, 62, n)}) for n in (17, 30, 5)]
  batches = jax.device_put(list(fedjax.padded_batch_client_datasets(
      datasets, batch_size=8)))
  want = {k: float(v) for k, v in
          fedjax.evaluate_model(model, params, batches).items()}
  assert evaluation.evaluate(model, params, batches) == want
  with stats.counting_compilations() as compiles:
    assert evaluation.evaluate(model, params, batches) == want
  assert compiles.total == 0, compiles.by_program


@pytest.mark.parametrize('args,expected', [
    (['--task=bogus'], 'value should be one of'),
    (['--num_rounds=0'], 'num_rounds'),
    (['--task=emnist', '--data_dir=/nonexistent/dir'], 'federated_emnist_train.sqlite'),
])
def test_binary_bad_flags_one_clear_error(repo_root, tmp_path, args, expected):
  env = dict(os.environ, FEDLITE_DATA_DIR=str(tmp_path / 'empty'),
             HOME=str(tmp_path))
  proc = subprocess.run(
      [sys.executable, str(repo_root / 'experiments' / 'run_experiment.py'),
       f'--output_dir={tmp_path / "o"}', *args],
      capture_output=True, text=True, env=env, timeout=300)
  assert proc.returncode != 0
  assert expected in proc.stderr
  assert 'Traceback' not in proc.stderr


def test_fedavg_local_steps_equals_sgd_local_steps(tmp_path):
  """``fedavg --local_steps=3`` is FedAvg with 3 local iterations.

  With one client per round the aggregation weights cancel, so it must equal
  the independently built ``sgd --local_steps=3`` (uniform weights, no
  compressor, same batches), and differ from one local epoch.
  """
  kw = dict(task='embedded_mnist', num_rounds=2, clients_per_round=1,
            client_batch_size=20, eval_every=2, eval_num_clients=3,
            progress=False, client_lr=0.05)
  steps = runner.run(RunConfig(
      algorithm='fedavg', output_dir=str(tmp_path / 'a'),
      options={'local_steps': 3}, **kw))
  sgd = runner.run(RunConfig(
      algorithm='sgd', output_dir=str(tmp_path / 'b'),
      options={'local_steps': 3}, **kw))
  epoch = runner.run(RunConfig(
      algorithm='fedavg', output_dir=str(tmp_path / 'c'), **kw))
  assert steps['final_eval']['loss'] == pytest.approx(
      sgd['final_eval']['loss'], rel=1e-6)
  assert abs(steps['final_eval']['loss'] - epoch['final_eval']['loss']) > 1e-3
  with pytest.raises(ConfigError, match='--local_steps=3'):
    runner.run(RunConfig(
        algorithm='fedavg', output_dir=str(tmp_path / 'd'), client_epochs=2,
        options={'local_steps': 3}, **kw))


def test_skipped_clients_counted_per_round_in_metrics_and_summary(
    tmp_path, monkeypatch):
  # An algorithm that reports its first client of the 2nd round as skipped
  # (as --nonfinite_updates=skip does): 0 upload bits, counted once.
  real_build = build_lib.build_algorithm
  calls = {'n': 0}

  def build(ctx):
    alg = real_build(ctx)

    def apply(state, clients):
      state, diags = alg.apply(state, clients)
      calls['n'] += 1
      if calls['n'] == 2:
        first = next(iter(diags))
        diags[first] = dict(diags[first], skipped=True, upload_bits=0.0)
      return state, diags

    return alg.__class__(alg.init, apply)

  monkeypatch.setattr(build_lib, 'build_algorithm', build)
  out = tmp_path / 'skip'
  summary = run(RunConfig(num_rounds=3, output_dir=str(out), **SMALL))
  rows = outputs.read_metrics(out / 'metrics.jsonl')
  assert [r['round'] for r in rows] == [1, 2, 3]
  assert [r['train/skipped_clients'] for r in rows] == [0, 1, 0]
  assert [r['train/clients'] for r in rows] == [3, 3, 3]
  assert 'skipped_clients' not in summary['final_eval']
  comm = summary['communication']
  assert comm['skipped_client_rounds'] == 1
  n = comm['num_params']
  # 3 rounds x 3 clients; the skipped client sent nothing.
  assert comm['total_upload_bytes'] == (9 - 1) * n * 4
  assert comm['total_download_bytes'] == 9 * n * 4


@pytest.fixture
def jax_cache_setting():
  """JAX's compilation cache enabled (a benchmark run in this process may
  have disabled it); its settings restored after the test."""
  from jax.experimental.compilation_cache import compilation_cache
  keep = (jax.config.jax_compilation_cache_dir,
          jax.config.jax_persistent_cache_min_compile_time_secs,
          jax.config.jax_enable_compilation_cache)
  jax.config.update('jax_enable_compilation_cache', True)
  yield
  jax.config.update('jax_persistent_cache_min_compile_time_secs', keep[1])
  jax.config.update('jax_enable_compilation_cache', keep[2])
  compilation_cache.set_cache_dir(keep[0])
  compilation_cache.reset_cache()


def test_compilation_cache_dir_settings(tmp_path, monkeypatch,
                                        jax_cache_setting):
  from fedlite_jax.training import start
  assert start.use_compilation_cache('off') is None
  assert jax.config.jax_compilation_cache_dir is None
  # auto: JAX's own setting first, else under $XDG_CACHE_HOME.
  monkeypatch.setenv('XDG_CACHE_HOME', str(tmp_path / 'xdg'))
  assert start.use_compilation_cache('auto') == str(
      tmp_path / 'xdg' / 'fedlite_jax' / 'xla')
  assert (tmp_path / 'xdg' / 'fedlite_jax' / 'xla').is_dir()
  jax.config.update('jax_compilation_cache_dir', str(tmp_path / 'mine'))
  assert start.use_compilation_cache('auto') == str(tmp_path / 'mine')
  assert start.use_compilation_cache(str(tmp_path / 'a' / 'b')) == str(
      tmp_path / 'a' / 'b')
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / 'a' / 'b')
  # Programs of 0.1 s or more are cached, unless the user chose (JAX: 1 s).
  monkeypatch.setenv('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '2')
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 1.0)
  start.use_compilation_cache('auto')
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 1.0
  monkeypatch.delenv('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS')
  start.use_compilation_cache('auto')
  assert jax.config.jax_persistent_cache_min_compile_time_secs == 0.1
  (tmp_path / 'file').write_text('x')
  with pytest.raises(ConfigError, match=r'^--compilation_cache_dir=.*file/x: '
                     'cannot create'):
    start.use_compilation_cache(str(tmp_path / 'file' / 'x'))
  # JAX's cache disabled (JAX_ENABLE_COMPILATION_CACHE=false): untouched.
  jax.config.update('jax_enable_compilation_cache', False)
  assert start.use_compilation_cache(str(tmp_path / 'c')) is None
  assert jax.config.jax_compilation_cache_dir == str(tmp_path / 'a' / 'b')
  assert not (tmp_path / 'c').exists()


def test_second_run_loads_its_programs_from_the_cache(tmp_path,
                                                      jax_cache_setting):
  """A run with --compilation_cache_dir writes its compiled programs there;
  the same flags again (another output folder) load them (JAX's cache-hit
  events) and give the same metrics."""
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
  hits = []
  listener = lambda event, **kw: hits.append(event) if event == (
      '/jax/compilation_cache/cache_hits') else None
  jax.monitoring.register_event_listener(listener)
  rows = []
  try:
    for name in ('first', 'second'):
      hits.clear()
      run(RunConfig(num_rounds=2, output_dir=str(tmp_path / name),
                    compilation_cache_dir=str(tmp_path / 'xla'), **SMALL))
      rows.append(outputs.read_metrics(tmp_path / name / 'metrics.jsonl'))
      if name == 'first':
        entries = set(os.listdir(tmp_path / 'xla'))
        assert entries
  finally:
    jax.monitoring.unregister_event_listener(listener)
  assert hits
  assert set(os.listdir(tmp_path / 'xla')) == entries  # Nothing new.
  # The same rows but the times and the compilations (the second run also
  # reuses programs this process holds in memory).
  strip = lambda r: {k: v for k, v in r.items()
                     if not k.startswith('time/') and 'compil' not in k}
  assert [strip(r) for r in rows[0]] == [strip(r) for r in rows[1]]


def test_client_keys_in_one_call_equal_one_by_one():
  """``loop.client_rngs`` (the runner's, one compiled call) gives each
  client ``client_rng``'s key, bit for bit."""
  from fedlite_jax.training import loop  # pylint: disable=g-import-not-at-top
  ids = [b'a', b'f0123', b'', bytes(range(40))]
  for seed, r in ((0, 0), (7, 3), (2**32 - 1, 999)):
    got = loop.client_rngs(seed, r, ids)
    assert got.shape == (len(ids), 2) and got.dtype == np.uint32
    for cid, key in zip(ids, got):
      np.testing.assert_array_equal(key, np.asarray(
          runner.client_rng(seed, r, cid)))


#: --upload / --download stage strings a run must parse once each.
_STAGES = {'upload': 'uniform_quantization:8',
           'download': 'uniform_quantization:16'}


def test_stage_strings_parsed_once_per_run(tmp_path, monkeypatch):
  """A run parses its --upload and --download once each (before anything
  is written) and carries the chains to the algorithm: the ledger counts
  8 / 16 bits per parameter."""
  from fedlite_jax import transforms  # pylint: disable=g-import-not-at-top
  parsed = []
  real = transforms.parse_chain

  def counting(spec, *args, **kwargs):
    parsed.append(spec)
    return real(spec, *args, **kwargs)

  monkeypatch.setattr(transforms, 'parse_chain', counting)
  summary = run(RunConfig(num_rounds=1, output_dir=str(tmp_path / 'o'),
                          options=dict(_STAGES), **SMALL))
  assert sorted(parsed) == sorted(_STAGES.values())
  comm = summary['communication']
  assert comm['total_upload_bytes'] == pytest.approx(
      3 * comm['num_params'], rel=1e-3)  # 8 bits x 3 clients (+ scales)
  assert comm['total_download_bytes'] == pytest.approx(
      3 * comm['num_params'] * 2, rel=1e-3)


def test_validate_only_parses_stage_strings_once(repo_root, tmp_path):
  """``run_experiment.py --validate_only`` parses each stage string once
  (its checks, the bits per client)."""
  path = str(repo_root / 'experiments' / 'run_experiment.py')
  script = textwrap.dedent(f'''
      import importlib.util, sys
      from fedlite_jax import transforms
      parsed = []
      real = transforms.parse_chain
      def counting(spec, *args, **kwargs):
        parsed.append(spec)
        return real(spec, *args, **kwargs)
      transforms.parse_chain = counting
      spec = importlib.util.spec_from_file_location('run_experiment', {path!r})
      binary = importlib.util.module_from_spec(spec)
      spec.loader.exec_module(binary)
      argv = binary.parse_flags(['run_experiment.py', '--validate_only',
                                 '--upload={_STAGES["upload"]}',
                                 '--download={_STAGES["download"]}',
                                 '--output_dir={tmp_path}/out'])
      binary.main(argv)
      print('PARSED', *sorted(parsed))
      ''')
  proc = subprocess.run([sys.executable, '-c', script], capture_output=True,
                        text=True, timeout=600, cwd=tmp_path,
                        env=dict(os.environ, HOME=str(tmp_path),
                                 PYTHONPATH=str(repo_root)))
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert 'upload bits per client: ' in proc.stdout
  assert proc.stdout.strip().splitlines()[-1].split()[1:] == sorted(
      _STAGES.values())
