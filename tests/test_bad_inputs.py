"""Every bad input to ``experiments/run_experiment.py`` gets one clear error.

Each row of :data:`ROWS` runs the binary as a user would and checks that it
exits non-zero, prints no traceback, and names the bad flag or file. Most rows
fail at validation, before any data is loaded. Data rows use a tiny FEMNIST
copy in FedJAX's format written here (and corrupt variants of it), so they
need no downloaded data; ``$FEDLITE_DATA_DIR`` points at the good copy, so an
explicit ``--data_dir`` that silently fell back to it would train and fail
the row.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import pathlib
import re
import shutil
import sqlite3
import subprocess
import sys
import textwrap

import fedjax
import numpy as np
import pytest

from fedlite_jax import datasets
from fedlite_jax.training import config as config_lib
from fedlite_jax.training import registry
from fedlite_jax.training import tasks

BASE = ['--num_rounds=1', '--progress=false']
EMB = ['--num_clients=5', '--clients_per_round=2',
       '--max_examples_per_client=10']
EMNIST = ['--task=emnist', '--clients_per_round=2']
SPLITS = ('train', 'test')


def _emnist_file(path: pathlib.Path, num_clients: int, seed: int) -> None:
  """A FedJAX-format EMNIST split: client ids like FedJAX's, 3 examples."""
  rng = np.random.default_rng(seed)
  with fedjax.SQLiteFederatedDataBuilder(str(path)) as builder:
    builder.add_many([
        (f'{i:016x}:f{i:04d}_00'.encode(),
         {'pixels': rng.random((3, 28, 28), dtype=np.float32),
          'label': rng.integers(0, 62, 3).astype(np.int32)})
        for i in range(num_clients)])


def _both(directory: pathlib.Path, write) -> pathlib.Path:
  directory.mkdir(parents=True)
  for split in SPLITS:
    write(directory / f'federated_emnist_{split}.sqlite')
  return directory


@pytest.fixture(scope='module')
def data(tmp_path_factory) -> pathlib.Path:
  """Good and bad FEMNIST directories, and a plain file."""
  root = tmp_path_factory.mktemp('bad_inputs')
  good = _both(root / 'good', lambda p: _emnist_file(p, 24, 0))
  (root / 'empty').mkdir()
  (root / 'afile').write_bytes(np.random.default_rng(1).bytes(4096))

  _both(root / 'random',
        lambda p: p.write_bytes(np.random.default_rng(2).bytes(50_000)))

  def truncated(p):
    whole = (good / p.name).read_bytes()
    p.write_bytes(whole[:len(whole) // 2])
  _both(root / 'truncated', truncated)

  def sql(*statements):
    def write(p):
      connection = sqlite3.connect(p)
      for statement, args in statements:
        connection.execute(statement, args)
      connection.commit()
      connection.close()
    return write

  _both(root / 'no_table', sql(('CREATE TABLE other (a)', ())))
  _both(root / 'wrong_columns',
        sql(('CREATE TABLE federated_data (a, b)', ()),
            ('INSERT INTO federated_data VALUES (1, 2)', ())))
  _both(root / 'no_clients',
        sql(('CREATE TABLE federated_data (client_id BLOB, data BLOB, '
             'num_examples INTEGER)', ())))
  _both(root / 'garbage_blob',
        sql(('CREATE TABLE federated_data (client_id BLOB, data BLOB, '
             'num_examples INTEGER)', ()),
            ('INSERT INTO federated_data VALUES (?, ?, 3)',
             (b'f0000_00', b'not zlib at all'))))

  def other_features(p):
    with fedjax.SQLiteFederatedDataBuilder(str(p)) as builder:
      builder.add_many([(b'f0000_00', {'snippets': np.array(
          [b'to be', b'or not'], dtype=object)})])
  _both(root / 'wrong_features', other_features)

  tff = root / 'tff_random'
  tff.mkdir()
  (tff / 'emnist_all.sqlite').write_bytes(b'\0' * 5000)
  h5 = root / 'h5_random'
  h5.mkdir()
  for split in SPLITS:
    (h5 / f'fed_emnist_{split}.h5').write_bytes(
        np.random.default_rng(3).bytes(5000))
  return root


def _env(repo_root, tmp_path, **extra):
  """This checkout first on the path; empty caches under ``tmp_path``."""
  env = dict(os.environ, HOME=str(tmp_path / 'home'),
             FEDLITE_CACHE_DIR=str(tmp_path / 'cache'), **extra)
  env['PYTHONPATH'] = os.pathsep.join(
      [str(repo_root)] + [p for p in [os.environ.get('PYTHONPATH')] if p])
  return env


def _run(repo_root, args, env_extra, tmp_path):
  env = _env(repo_root, tmp_path, **env_extra)
  return subprocess.run(
      [sys.executable, str(repo_root / 'experiments' / 'run_experiment.py'),
       *args], capture_output=True, text=True, env=env, timeout=900,
      cwd=tmp_path)


# (id, flags, text the error must contain). {data}: the fixture's directory;
# {tmp}: this row's own directory. Every row gets BASE and, unless it sets
# one, --output_dir={tmp}/out.
ROWS = [
    # Non-finite numbers: `value <= 0` is False for NaN.
    ('client_lr_nan', EMB + ['--client_lr=nan'], '--client_lr=nan'),
    ('client_lr_inf', EMB + ['--client_lr=inf'], '--client_lr=inf'),
    ('server_lr_nan', EMB + ['--server_lr=nan'], '--server_lr=nan'),
    ('clip_nan', EMB + ['--client_clip_norm=nan'], '--client_clip_norm=nan'),
    ('clip_inf', EMB + ['--client_clip_norm=inf'], '--client_clip_norm=inf'),
    ('beta1_nan', EMB + ['--server_optimizer=adam', '--server_beta1=nan'],
     '--server_beta1=nan'),
    ('beta2_inf', EMB + ['--server_optimizer=adam', '--server_beta2=inf'],
     '--server_beta2=inf'),
    ('server_eps_nan', EMB + ['--server_optimizer=adam', '--server_eps=nan'],
     '--server_eps=nan'),
    ('alpha_nan', EMB + ['--dirichlet_alpha=nan'], '--dirichlet_alpha=nan'),
    ('alpha_inf', EMB + ['--dirichlet_alpha=inf'], '--dirichlet_alpha=inf'),
    ('fedprox_mu_nan', EMB + ['--algorithm=fedprox', '--fedprox_mu=nan'],
     '--fedprox_mu=nan'),
    ('lambda_inf', EMB + ['--algorithm=fedlite', '--correction_lambda=inf'],
     '--correction_lambda=inf'),
    ('phi_inf', EMB + ['--algorithm=fedlite', '--fedlite_phi=inf'],
     '--fedlite_phi=inf'),
    ('sketch_momentum_nan', EMB + ['--algorithm=fetchsgd',
                                   '--sketch_momentum=nan'],
     '--sketch_momentum=nan'),
    ('terngrad_clip_nan', EMB + ['--upload=terngrad:nan'],
     "--upload=terngrad:nan: bad compression stage 'terngrad:nan'"),
    ('mime_eps_inf', EMB + ['--algorithm=mime_lite', '--mime_base_eps=inf'],
     '--mime_base_eps=inf'),
    ('split_server_lr_nan', EMB + ['--algorithm=splitfed',
                                   '--split_server_lr=nan'],
     '--split_server_lr=nan'),
    ('pvt_fraction_nan', EMB + ['--pvt_fraction=nan'], '--pvt_fraction=nan'),
    # Seeds outside numpy's RandomState range (PRNGKey would wrap them).
    ('seed_negative', EMB + ['--seed=-1'], '--seed=-1'),
    ('seed_2_32', EMB + ['--seed=4294967296'], '--seed=4294967296'),
    ('seed_2_63', EMB + ['--seed=9223372036854775808'], '--seed='),
    ('igc_seed_2_32', EMB + ['--algorithm=igc_static',
                             '--igc_seed=4294967296'], '--igc_seed'),
    ('sketch_seed_big', EMB + ['--algorithm=fetchsgd',
                               '--sketch_seed=99999999999'], '--sketch_seed'),
    ('num_clients_too_many', ['--num_clients=100000'], '--num_clients=100000'),
    # Output and checkpoint paths.
    ('output_dir_empty', EMB + ['--output_dir='], '--output_dir'),
    ('output_dir_is_file', EMB + ['--output_dir={data}/afile'],
     '--output_dir'),
    ('output_dir_under_file', EMB + ['--output_dir={data}/afile/run'],
     '--output_dir'),
    ('init_checkpoint_missing', EMB + ['--init_checkpoint={tmp}/none.msgpack'],
     '--init_checkpoint'),
    ('init_checkpoint_garbage', EMB + ['--init_checkpoint={data}/afile'],
     '--init_checkpoint'),
    ('init_checkpoint_empty', EMB + ['--init_checkpoint='],
     '--init_checkpoint'),
    # An explicit --data_dir wins (never $FEDLITE_DATA_DIR) and must hold
    # the data.
    ('data_dir_empty_string', EMNIST + ['--data_dir='], '--data_dir'),
    ('data_dir_missing', EMNIST + ['--data_dir={tmp}/nowhere'],
     'data_dir {tmp}/nowhere, which does not exist'),
    ('data_dir_without_data', EMNIST + ['--data_dir={data}/empty'],
     'data_dir {data}/empty'),
    ('data_dir_is_file', EMNIST + ['--data_dir={data}/afile'],
     'which is not a directory'),
    # Bad data files: one line naming the file.
    ('sqlite_random_bytes', EMNIST + ['--data_dir={data}/random'],
     'random/federated_emnist_train.sqlite is not an SQLite database'),
    ('sqlite_truncated', EMNIST + ['--data_dir={data}/truncated'],
     'truncated/federated_emnist_train.sqlite is truncated'),
    ('sqlite_no_table', EMNIST + ['--data_dir={data}/no_table'],
     'no_table/federated_emnist_train.sqlite has no federated_data table'),
    ('sqlite_wrong_columns', EMNIST + ['--data_dir={data}/wrong_columns'],
     'wrong_columns/federated_emnist_train.sqlite: table federated_data '
     'lacks'),
    ('sqlite_no_clients', EMNIST + ['--data_dir={data}/no_clients'],
     'no_clients/federated_emnist_train.sqlite holds no clients'),
    ('sqlite_garbage_blob', EMNIST + ['--data_dir={data}/garbage_blob'],
     'garbage_blob/federated_emnist_train.sqlite, client'),
    ('sqlite_wrong_features', EMNIST + ['--data_dir={data}/wrong_features'],
     "feature 'pixels' is missing"),
    ('tff_sqlite_zeros', EMNIST + ['--data_dir={data}/tff_random'],
     'tff_random/emnist_all.sqlite is not an SQLite database'),
    ('tff_hdf5_random', EMNIST + ['--data_dir={data}/h5_random'],
     'h5_random/fed_emnist_train.h5 is not a readable HDF5 file'),
    # Options of another algorithm, fields of another task or setting.
    ('topk_k_with_fedavg', EMB + ['--topk_k=5'],
     '--topk_k is an option of --algorithm=fetchsgd, not of fedavg'),
    # DP-FedAvg flags: one line naming the flag and the allowed range.
    ('dp_clip_zero', EMB + ['--dp_clip=0', '--dp_noise_multiplier=1'],
     '--dp_clip=0.0: must be > 0'),
    ('dp_negative_noise', EMB + ['--dp_clip=1', '--dp_noise_multiplier=-2'],
     '--dp_noise_multiplier=-2.0: must be >= 0'),
    ('dp_delta_one', EMB + ['--dp_clip=1', '--dp_noise_multiplier=1',
                            '--dp_delta=1'],
     '--dp_delta=1.0: must be in (0, 1)'),
    ('dp_unreachable_epsilon', EMB + ['--dp_clip=1',
                                      '--dp_target_epsilon=1e-9'],
     '--dp_target_epsilon=1e-09: target_epsilon=1e-09 is unreachable'),
    ('dp_with_topk', EMB + ['--algorithm=topk', '--dp_clip=1'],
     '--dp_clip is an option of --algorithm=fedavg, fedprox, igc_static, not '
     'of topk'),
    # Removed compression flags: one line naming the stage-string flags.
    ('removed_upload_bits', EMB + ['--upload_bits=8'],
     '--upload_bits=8 was removed; use --upload=uniform_quantization:8'),
    ('removed_uniform_and_download_bits',
     EMB + ['--upload_quantizer=uniform', '--upload_bits=4',
            '--download_bits=16'],
     '--upload_quantizer=uniform --upload_bits=4 --download_bits=16 were '
     'removed; use --download=uniform_quantization:16 '
     '--upload=uniform_quantization:4'),
    ('removed_terngrad_noclip', EMB + ['--upload_quantizer=terngrad',
                                       '--noterngrad_clip'],
     'were removed; use --upload=terngrad:none'),
    ('removed_upload_clip_std', EMB + ['--upload_clip_std=2'],
     '--upload_clip_std=2 was removed; use transforms.uniform_quantization'),
    ('removed_topk_k_with_topk', EMB + ['--algorithm=topk', '--topk_k=5',
                                        '--topk_index_bits=none'],
     'were removed; use --upload=top_k:5:none'),
    ('removed_igc_upload_quant_bits', EMB + ['--algorithm=igc_static',
                                             '--igc_upload_quant_bits=8'],
     '--igc_upload_quant_bits=8 was removed; use '
     '--upload=uniform_quantization:8'),
    # A removed engine flag names the flag that replaced it.
    ('removed_clients_per_chunk', EMB + ['--clients_per_chunk=8'],
     '--clients_per_chunk=8 was removed; use --lanes_per_device=8'),
    ('intrinsic_dim_with_fedavg', EMB + ['--intrinsic_dim=64'],
     '--intrinsic_dim is an option of'),
    ('num_subvectors_with_splitfed', EMB + ['--algorithm=splitfed',
                                            '--num_subvectors=8'],
     '--num_subvectors is an option of --algorithm=fedlite'),
    ('alpha_with_emnist', EMNIST + ['--dirichlet_alpha=0.3'],
     '--dirichlet_alpha applies to --task=embedded_mnist'),
    ('num_clients_with_emnist', EMNIST + ['--num_clients=7'],
     '--num_clients applies to --task=embedded_mnist'),
    ('tokenizer_with_emnist', EMNIST + ['--tokenizer=word'],
     '--tokenizer applies to --task=shakespeare, stackoverflow_nwp'),
    ('model_with_emnist', EMNIST + ['--model=lstm_tiny'],
     '--model applies to --task=shakespeare, stackoverflow_nwp'),
    ('vocab_size_with_so_tag', ['--task=stackoverflow_tag',
                                '--vocab_size=100'],
     '--vocab_size applies to --task=shakespeare, stackoverflow_nwp'),
    ('data_dir_with_embedded', EMB + ['--data_dir={data}/good'],
     '--data_dir applies to --task=emnist'),
    ('sp_vocab_with_word', ['--task=shakespeare', '--sp_vocab_size=100'],
     '--sp_vocab_size applies to --tokenizer=sentencepiece'),
    ('vocab_with_sentencepiece', ['--task=shakespeare',
                                  '--tokenizer=sentencepiece',
                                  '--vocab_size=100'],
     '--vocab_size sets the word vocabulary'),
    ('loss_reduction_without_model', ['--task=shakespeare',
                                      '--lm_loss_reduction=token_mean'],
     '--lm_loss_reduction applies to the --model presets'),
    ('beta1_with_sgd_server', EMB + ['--server_beta1=0.5'],
     '--server_beta1 applies to --server_optimizer=adam or yogi'),
    ('eps_with_sgd_server', EMB + ['--server_eps=0.001'],
     '--server_eps applies to --server_optimizer=adam, adagrad or yogi'),
    ('server_lr_with_fedlite', EMB + ['--algorithm=fedlite',
                                      '--server_lr=1.0'],
     '--server_lr is not used by --algorithm=fedlite'),
    ('client_epochs_with_splitfed', EMB + ['--algorithm=splitfed',
                                           '--client_epochs=2'],
     '--client_epochs is not used by --algorithm=splitfed'),
    ('coordinator_single_process', EMB + ['--coordinator_address=h:1'],
     '--coordinator_address applies to multi-host runs'),
    ('lanes_per_device_text', EMB + ['--lanes_per_device=many'],
     "--lanes_per_device=many: must be 'auto' or an integer >= 1"),
    ('lanes_per_device_zero', EMB + ['--lanes_per_device=0'],
     "--lanes_per_device=0: must be 'auto' or an integer >= 1"),
    ('lanes_per_device_with_loop', EMB + ['--round_engine=loop',
                                          '--lanes_per_device=4'],
     '--lanes_per_device applies to --round_engine=vmap'),
    ('segment_steps_with_loop', EMB + ['--round_engine=loop',
                                       '--segment_steps=2'],
     '--segment_steps applies to --round_engine=vmap'),
    ('conv_implementation_bad', EMB + ['--conv_implementation=fft'],
     'flag --conv_implementation=fft: value should be one of '
     '<auto|lax|im2col>'),
    ('compute_dtype_bad', EMB + ['--compute_dtype=float16'],
     'flag --compute_dtype=float16: value should be one of '
     '<float32|bfloat16>'),
    ('client_cache_negative', EMB + ['--client_cache_mb=-1'],
     '--client_cache_mb'),
    ('compilation_cache_dir_empty', EMB + ['--compilation_cache_dir='],
     "--compilation_cache_dir='': empty path"),
    # --validate_only builds the chains, so it rejects what a run rejects.
    ('validate_only_unknown_stage', EMB + ['--validate_only',
                                           '--upload=bogus:3'],
     "--upload=bogus:3: bad compression stage 'bogus:3'"),
    ('validate_only_33_bits', EMB + ['--validate_only',
                                     '--upload=uniform_quantization:33'],
     'bits must be in [1, 32]'),
    ('validate_only_bad_download', EMB + ['--validate_only',
                                          '--download=top_k:0'],
     '--download=top_k:0'),
    # Caught after the data is loaded (the model fixes d and the batch).
    ('centroids_over_subvectors', EMB + [
        '--algorithm=fedlite', '--num_subvectors=4', '--num_groups=2',
        '--client_batch_size=5', '--num_centroids=11'],
     '--num_centroids=11: must be at most the subvectors per group'),
    # absl's own parsing errors.
    ('float_not_a_number', EMB + ['--client_lr=abc'], '--client_lr=abc'),
    ('unknown_task', ['--task=bogus'], '--task'),
    ('flagfile_missing', ['--flagfile={tmp}/none.flags'], 'none.flags'),
]


@pytest.mark.parametrize('args,expected', [
    pytest.param(args, expected, id=name) for name, args, expected in ROWS])
def test_bad_input_one_clear_error(repo_root, data, tmp_path, args, expected):
  fill = lambda s: s.format(data=data, tmp=tmp_path)
  args = [fill(a) for a in args]
  if not any(a.startswith('--output_dir=') for a in args):
    args.append(f'--output_dir={tmp_path}/out')
  proc = _run(repo_root, BASE + args,
              {'FEDLITE_DATA_DIR': str(data / 'good')}, tmp_path)
  assert proc.returncode != 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  assert 'Traceback' not in proc.stderr, proc.stderr[-4000:]
  assert fill(expected) in proc.stderr, proc.stderr[-4000:]
  assert not (tmp_path / 'out' / 'metrics.jsonl').exists()


def test_rows_cover_many_bad_inputs():
  assert len({name for name, _, _ in ROWS}) == len(ROWS) >= 40


def test_good_tiny_data_trains(repo_root, data, tmp_path):
  """The fixture's good copy trains: the data rows fail for their reason."""
  # A small client lr: one round on a few random examples must not leave
  # the model worse than chance (the runner fails such a run).
  proc = _run(repo_root, BASE + EMNIST + [f'--data_dir={data}/good',
                                          '--eval_num_clients=2',
                                          '--client_lr=0.001',
                                          f'--output_dir={tmp_path}/out'],
              {}, tmp_path)
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert (tmp_path / 'out' / 'summary.json').exists()


def test_validate_only_checks_without_training(repo_root, tmp_path):
  ok = _run(repo_root, ['--validate_only', '--algorithm=fedlite',
                        f'--output_dir={tmp_path}/out'], {}, tmp_path)
  assert ok.returncode == 0, ok.stderr[-4000:]
  assert 'flags OK' in ok.stdout and '--algorithm=fedlite' in ok.stdout
  assert not (tmp_path / 'out').exists()
  bad = _run(repo_root, ['--validate_only', '--topk_k=3'], {}, tmp_path)
  assert bad.returncode == 2 and '--topk_k' in bad.stderr


@pytest.mark.parametrize('case', ['missing_data_dir', 'oversized_cohort',
                                  'taken_output_dir'])
def test_validate_only_catches_what_the_run_would_meet(repo_root, tmp_path,
                                                       case):
  """Each: one error line, exit non-zero, nothing written."""
  out = tmp_path / 'out'
  args = {'missing_data_dir': ['--task=emnist',
                               f'--data_dir={tmp_path}/nonexistent'],
          'oversized_cohort': EMB + ['--clients_per_round=500'],
          'taken_output_dir': EMB + ['--client_lr=0.5']}[case]
  expected = {'missing_data_dir': f'data_dir {tmp_path}/nonexistent',
              'oversized_cohort': '--clients_per_round=500 exceeds the 5 '
                                  'training clients',
              'taken_output_dir': 'holds results of a run with other flags '
                                  '(client_lr'}[case]
  if case == 'taken_output_dir':  # Results of the same command, lr 0.1.
    first = _run(repo_root, EMB + ['--num_rounds=1', '--client_lr=0.1',
                                   f'--output_dir={out}'], {}, tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
  before = sorted(p.name for p in tmp_path.rglob('*'))
  proc = _run(repo_root, ['--validate_only', f'--output_dir={out}', *args],
              {}, tmp_path)
  assert proc.returncode == 2, proc.stderr[-2000:]
  errors = [l for l in proc.stderr.splitlines() if 'error:' in l]
  assert len(errors) == 1 and expected in errors[0], proc.stderr[-2000:]
  if case == 'missing_data_dir':  # The run's message: files, folders.
    assert proc.stderr.rstrip().endswith('(pass --allow_download to let '
                                         f'FedJAX download its copy into '
                                         f'{tmp_path}/nonexistent).'), (
                                             proc.stderr[-2000:])
  else:
    assert proc.stderr.rstrip().endswith(errors[0])  # The last line.
  assert sorted(p.name for p in tmp_path.rglob('*')) == before


def test_validate_only_bits_are_what_a_round_sends(repo_root, tmp_path):
  """The printed bits per client are those the ledger counts in a run."""
  flags = EMB + ['--upload=uniform_quantization:8',
                 '--download=uniform_quantization:16', '--num_rounds=1',
                 f'--output_dir={tmp_path}/out']
  proc = _run(repo_root, ['--validate_only', *flags], {}, tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  printed = {way: float(re.search(rf'{way} bits per client: ([\d,]+)',
                                  proc.stdout).group(1).replace(',', ''))
             for way in ('upload', 'download')}
  run = _run(repo_root, flags, {}, tmp_path)
  assert run.returncode == 0, run.stderr[-2000:]
  with (tmp_path / 'out' / 'communication.csv').open() as f:
    rows = list(csv.DictReader(f))
  assert rows and all(float(r['upload_bits']) == printed['upload'] and
                      float(r['download_bits']) == printed['download']
                      for r in rows), (printed, rows[0])


def _load_binary(repo_root) -> str:
  """One line of Python that imports experiments/run_experiment.py as
  ``binary`` (for the scripts the tests run in a subprocess)."""
  path = str(repo_root / 'experiments' / 'run_experiment.py')
  return (f"import importlib.util; spec = importlib.util."
          f"spec_from_file_location('run_experiment', {path!r}); "
          "binary = importlib.util.module_from_spec(spec); "
          "spec.loader.exec_module(binary)")


def test_flagfiles_resolve_for_their_algorithm_and_task(repo_root, tmp_path):
  """Every experiments/configs/*.flags parses and validates (no training).

  One process parses each flagfile with the binary's flags and runs its
  checks, so an option of another algorithm or a field of another task in a
  flagfile fails here.
  """
  files = sorted((repo_root / 'experiments' / 'configs').glob('*.flags'))
  assert len(files) >= 10
  script = textwrap.dedent(f'''
      import importlib.util, sys
      {_load_binary(repo_root)}
      for path in sys.argv[1:]:
        binary.FLAGS.unparse_flags()
        binary.FLAGS(['run_experiment.py', '--flagfile=' + path])
        config = binary.checked_config()
        print('OK', path, config.task, config.algorithm)
      ''')
  proc = subprocess.run(
      [sys.executable, '-c', script, *map(str, files)], capture_output=True,
      text=True, timeout=900, cwd=tmp_path, env=_env(repo_root, tmp_path))
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert proc.stdout.count('OK ') == len(files), proc.stdout


def test_task_fields_name_real_tasks_and_fields():
  fields = {f.name for f in dataclasses.fields(config_lib.RunConfig)}
  assert set(config_lib.TASK_FIELDS) <= fields
  for users in config_lib.TASK_FIELDS.values():
    assert set(users) <= set(tasks.TASKS)
  assert set(config_lib.FILE_TASKS) | {'embedded_mnist'} == set(tasks.TASKS)
  for spec in registry.algorithms().values():
    assert set(spec.ignored_fields) <= fields, spec.name


def test_library_resolve_rejects_ignored_settings():
  defaults = tasks.get_task('emnist').defaults
  with pytest.raises(config_lib.ConfigError, match='--num_clients applies'):
    config_lib.resolve(config_lib.RunConfig(task='emnist', num_clients=7),
                       defaults)
  with pytest.raises(config_lib.ConfigError, match='--topk_k is an option'):
    config_lib.resolve(config_lib.RunConfig(task='emnist',
                                            options={'topk_k': 3}), defaults)
  with pytest.raises(config_lib.ConfigError, match='--bogus: no such'):
    config_lib.resolve(config_lib.RunConfig(task='emnist',
                                            options={'bogus': 3}), defaults)
  with pytest.raises(config_lib.ConfigError, match='--client_lr=nan'):
    config_lib.resolve(config_lib.RunConfig(task='emnist',
                                            client_lr=float('nan')), defaults)
  resolved = config_lib.resolve(config_lib.RunConfig(
      task='emnist', algorithm='fetchsgd', options={'topk_k': 3}), defaults)
  assert resolved.options['topk_k'] == 3
  # Removed compression options name their stage-string replacement.
  with pytest.raises(config_lib.ConfigError,
                     match='--topk_k=3 was removed; use --upload=top_k:3'):
    config_lib.resolve(config_lib.RunConfig(
        task='emnist', algorithm='topk', options={'topk_k': 3}), defaults)
  with pytest.raises(config_lib.ConfigError,
                     match='--download_bits=8 was removed; use '
                     '--download=uniform_quantization:8'):
    config_lib.resolve(config_lib.RunConfig(
        task='emnist', options={'download_bits': 8}), defaults)
  # Idempotent: the task defaults filled in (server_optimizer for fedlite,
  # which does not read it) do not count as set.
  fedlite = config_lib.resolve(config_lib.RunConfig(
      task='emnist', algorithm='fedlite'), defaults)
  assert fedlite.server_optimizer == 'sgd'
  assert config_lib.resolve(fedlite, defaults) == fedlite


def test_explicit_data_dir_never_falls_back(data, tmp_path, monkeypatch):
  monkeypatch.setenv('FEDLITE_DATA_DIR', str(data / 'good'))
  monkeypatch.setenv('HOME', str(tmp_path))
  train, _, _ = datasets.load_federated_data('emnist')
  assert train.num_clients() == 24  # $FEDLITE_DATA_DIR without data_dir.
  with pytest.raises(datasets.DatasetNotFoundError,
                     match='only place searched'):
    datasets.load_federated_data('emnist', str(data / 'empty'))
  copy = shutil.copytree(data / 'good', tmp_path / 'copy')
  _, _, info = datasets.load_federated_data('emnist', str(copy))
  assert info.source == str(copy)


#: Bad compression settings: --validate_only must print the real run's error.
STAGE_ROWS = [
    ['--upload=bogus:3'],
    ['--upload=uniform_quantization:33'],
    ['--upload=top_k:5,,uniform_quantization:8'],
    ['--upload=uniform_quantization:8,terngrad:x'],
    ['--upload=intrinsic_projection'],
    ['--download=top_k:0'],
    ['--download=uniform_quantization:8:2'],
    ['--pvt_fraction=0.5', '--upload=top_k:5'],
    ['--algorithm=topk', '--upload=top_k:abc'],
    ['--algorithm=igc_static', '--intrinsic_dim=8', '--upload=bogus'],
    ['--algorithm=igc_static', '--intrinsic_dim=8', '--igc_project_on_server',
     '--upload=uniform_quantization:8'],
    ['--algorithm=mime_lite', '--download=uniform_quantization:0'],
]


def test_validate_only_gives_the_real_runs_stage_errors(repo_root, tmp_path):
  """One process runs the binary's main() on each row twice, with and
  without --validate_only, and compares the one-line errors."""
  script = textwrap.dedent(f'''
      import contextlib, importlib.util, io, json, sys
      {_load_binary(repo_root)}
      out = []
      for i, row in enumerate(json.loads(sys.argv[1])):
        errors = []
        for extra in (['--validate_only'], []):
          binary.FLAGS.unparse_flags()
          binary.FLAGS(['run_experiment.py', *row, *extra,
                        '--output_dir={tmp_path}/out%d' % i])
          err = io.StringIO()
          code = 0
          with contextlib.redirect_stderr(err):
            try:
              binary.main(['run_experiment.py'])
            except SystemExit as e:
              code = e.code
          errors.append([code, err.getvalue()])
        out.append(errors)
      print(json.dumps(out))
      ''')
  rows = [BASE + EMB + row for row in STAGE_ROWS]
  proc = subprocess.run(
      [sys.executable, '-c', script, json.dumps(rows)], capture_output=True,
      text=True, timeout=900, cwd=tmp_path, env=_env(repo_root, tmp_path))
  assert proc.returncode == 0, proc.stderr[-4000:]
  results = json.loads(proc.stdout.strip().splitlines()[-1])
  for row, ((code_v, err_v), (code_r, err_r)) in zip(STAGE_ROWS, results):
    assert code_r == 2 and err_r.startswith('run_experiment.py: error: --'), (
        row, err_r[-2000:])
    assert (code_v, err_v) == (code_r, err_r), row
    assert err_r.count('\n') == 1, err_r


def test_removed_flags_are_answered_but_not_listed(repo_root, tmp_path):
  """Removed flags are no flags (``--helpfull`` does not list them); the
  binary takes them out of argv and flagfiles and names the replacement;
  docs/runner.md's removed-flags tables list every one."""
  script = textwrap.dedent(f'''
      import importlib.util, sys
      {_load_binary(repo_root)}
      print('REMOVED', *binary.REMOVED_FLAGS)
      print('DEFINED', *[n for n in binary.REMOVED_FLAGS if n in binary.FLAGS])
      rest = binary.parse_flags(['x', '--upload_bits', '8', '--seed=3',
                                 '--noterngrad_clip', '--', '--upload_bits=1'])
      print('REST', *rest)
      print('GIVEN', sorted(binary._removed_given.items()))
      print('RATIO', binary._ratio(1176.01), binary._ratio(12.54),
            binary._ratio(1.0))
      ''')
  proc = subprocess.run([sys.executable, '-c', script], capture_output=True,
                        text=True, timeout=600, cwd=tmp_path,
                        env=_env(repo_root, tmp_path))
  assert proc.returncode == 0, proc.stderr[-4000:]
  lines = {line.split(' ', 1)[0]: line.split(' ', 1)[1:]
           for line in proc.stdout.splitlines()}
  removed = lines['REMOVED'][0].split()
  assert 'clients_per_chunk' in removed and 'upload_bits' in removed
  assert not lines['DEFINED']
  assert lines['REST'] == ['x --upload_bits=1']  # after '--': an argument
  assert lines['GIVEN'] == ["[('terngrad_clip', False), ('upload_bits', '8')]"]
  assert lines['RATIO'] == ['1,176x 12.5x 1x']
  text = (repo_root / 'docs' / 'runner.md').read_text()
  starts = [m.start() for m in re.finditer(r'^\| removed \|', text, re.M)]
  assert starts  # Tables of removed compression and engine flags.
  table = ''.join(text[i:text.index('\n\n', i)] for i in starts)
  for name in removed + ['topk_k']:
    assert f'--{name}' in table or f'--no{name}' in table, name


#: Engine flags removed without a replacement, and the binary's one line.
REMOVED_ENGINE_ROWS = [
    (['--segment_loop=scan'], '--segment_loop was removed: segments always '
     'run as an on-device scan.'),
    (['--data_on_device', 'on'], '--data_on_device was removed: batches are '
     'made on the host.'),
    (['--steps_per_call=4'], '--steps_per_call was removed: the loop engine '
     'runs one jitted step per batch.'),
]


def test_removed_engine_flags_one_line_each(repo_root, tmp_path):
  """Each removed engine flag stops the binary (exit 2, with and without
  --validate_only) with one line saying what replaced it; the library
  refuses it as an option."""
  script = textwrap.dedent(f'''
      import contextlib, importlib.util, io, json, sys
      {_load_binary(repo_root)}
      out = []
      for row in json.loads(sys.argv[1]):
        for extra in (['--validate_only'], []):
          binary.FLAGS.unparse_flags()
          argv = binary.parse_flags(['run_experiment.py', *row, *extra])
          err = io.StringIO()
          code = 0
          with contextlib.redirect_stderr(err):
            try:
              binary.main(argv)
            except SystemExit as e:
              code = e.code
          out.append([code, err.getvalue()])
      print(json.dumps(out))
      ''')
  rows = [EMB + args + [f'--output_dir={tmp_path}/out']
          for args, _ in REMOVED_ENGINE_ROWS]
  proc = subprocess.run(
      [sys.executable, '-c', script, json.dumps(rows)], capture_output=True,
      text=True, timeout=600, cwd=tmp_path, env=_env(repo_root, tmp_path))
  assert proc.returncode == 0, proc.stderr[-4000:]
  results = json.loads(proc.stdout.strip().splitlines()[-1])
  for i, (_, line) in enumerate(REMOVED_ENGINE_ROWS):
    for code, err in results[2 * i:2 * i + 2]:
      assert code == 2 and err == f'run_experiment.py: error: {line}\n', err
  assert not (tmp_path / 'out').exists()
  defaults = tasks.get_task('embedded_mnist').defaults
  for name, value in (('segment_loop', 'scan'), ('data_on_device', 'on'),
                      ('steps_per_call', 4)):
    with pytest.raises(config_lib.ConfigError) as e:
      config_lib.resolve(config_lib.RunConfig(options={name: value}),
                         defaults)
    assert str(e.value).startswith(f'--{name} was removed: ')
    with pytest.raises(TypeError, match=name):  # No longer a field.
      config_lib.RunConfig(**{name: value})


def test_flags_come_from_run_config_metadata(repo_root, tmp_path):
  """Each RunConfig field is a flag with its default and help; library
  ValueErrors naming a parameter map to that flag."""
  script = textwrap.dedent(f'''
      import dataclasses, importlib.util
      {_load_binary(repo_root)}
      from fedlite_jax import rounds
      from fedlite_jax.training import config
      binary.FLAGS(['run_experiment.py'])
      for f in dataclasses.fields(config.RunConfig):
        if f.name == 'options':
          continue
        flag = binary.FLAGS[f.name]
        want = f.default if f.default is None or f.metadata['kind'] is not \\
            str else str(f.default)
        assert flag.default == want, (f.name, flag.default, want)
        assert f.name in ('algorithm',) or f.metadata['help'] in flag.help
        # (after an enum's <choices>, before the task defaults, if any)
        if f.default is None and config.RunConfig.__dataclass_fields__[
            f.name].metadata['kind'] is not str:
          assert 'default' in flag.help, (f.name, flag.help)
      assert binary.FLAGS['round_engine'].parser.enum_values == list(
          rounds.ENGINE_NAMES)
      assert binary._flag_named_in(
          'lanes_per_device must be >= 1; got 0.') == 'lanes_per_device'
      assert binary._flag_named_in('the model has no parameters') is None
      print('OK')
      ''')
  proc = subprocess.run([sys.executable, '-c', script], capture_output=True,
                        text=True, timeout=600, cwd=tmp_path,
                        env=_env(repo_root, tmp_path))
  assert proc.returncode == 0 and 'OK' in proc.stdout, proc.stderr[-4000:]
