#!/usr/bin/env python3
"""Our round engines against FedJAX's ``jit`` backend, rounds as training runs.

Per model, engine, compute dtype and cohort size: ``--rounds`` FedAvg
rounds, each on a FRESH cohort. Printed: s/round (median after the first
round), its ratio to FedJAX's ``jit`` backend and to the loop engine at the
same model and cohort, the run's wall time, its XLA compilations (all, the
client programs', those after round 1) and their seconds, peak memory (the
device's ``peak_bytes_in_use``, else the process's peak RSS), the vmap
engine's lanes, sequential and executed/useful local steps. Engines:
``loop``, ``vmap`` (``fedlite_jax.algorithms.federated_averaging``; the
runner's ``--lanes_per_device``, ``--segment_steps``, ``--slots``),
``fedjax_jit`` (``fedjax.algorithms.fed_avg`` on FedJAX's default backend,
float32: the reference), ``fedjax_vmap`` (the same on
``rounds.VmapBackend``). Models: the EMNIST CNN on FEMNIST
(``$FEDLITE_DATA_DIR``, else synthetic) and ``fedlite_jax.models.lm``'s
(Ro et al. 2022, Table 1) on synthetic tokens. Cohorts and keys depend only
on ``--seed``, the round and the client.

Each (model, engine, dtype) runs in its own process (``--isolate``). A
cohort estimated over ``--max_seconds`` (:func:`estimate_seconds`) or past
``--total_seconds`` is skipped with the reason. ``--profile``:
``--profile_rounds`` more rounds per row under ``jax.profiler.trace``
(``trace_summary.py``), trace and summary in ``--profile_dir``. JAX's
persistent compilation cache is off unless ``--compilation_cache_dir``.

  python benchmarks/bench_rounds.py --models=transformer_large \\
      --engines=vmap,fedjax_jit --cohorts=100 --compute_dtype=float32,bfloat16
  python benchmarks/bench_rounds.py --models=femnist --engines=vmap --profile
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fedlite_jax  # noqa: E402,F401  (FedJAX compatibility fixes first)
import fedjax  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

import trace_summary  # noqa: E402
from fedlite_jax import datasets  # noqa: E402
from fedlite_jax import models  # noqa: E402
from fedlite_jax.algorithms import federated_averaging  # noqa: E402
from fedlite_jax.models import layers  # noqa: E402
from fedlite_jax.models import lm  # noqa: E402
from fedlite_jax.rounds import VmapBackend  # noqa: E402
from fedlite_jax.rounds import stats as stats_lib  # noqa: E402
from fedlite_jax.training.loop import client_rngs  # noqa: E402

ENGINES = ('loop', 'vmap', 'fedjax_jit', 'fedjax_vmap')
#: Run first for each model, so that every later row prints its ratios.
REFERENCE_ENGINES = ('fedjax_jit', 'loop')
MODELS = ('femnist',) + tuple(lm.PRESETS)
DTYPES = ('float32', 'bfloat16')
FEMNIST_BATCH, LM_BATCH = 20, 16
LM_LENGTH, LM_VOCAB = lm.DEFAULT_MAX_LENGTH, lm.DEFAULT_VOCAB_SIZE


def population(model: str, cohort: int, seed: int, max_examples: int,
               data_dir: Optional[str]) -> tuple[list, str]:
  """``(clients, data)``: FEMNIST's writers (repeated under new ids up to
  ``cohort``) when the data loads, else ``max(4 cohort, 1000)`` synthetic
  clients with lognormal example counts (FEMNIST: median 200, sigma 0.45, in
  [8, 500]; LM: median 48, sigma 1.0, in [1, 256]) viewing one pool."""
  if model == 'femnist':
    try:
      train = datasets.load_federated_data('emnist', data_dir)[0]
    except Exception:  # pylint: disable=broad-except  # No data: synthetic.
      train = None
    if train is not None:
      ids = sorted(cid for cid, _ in train.client_sizes())
      writers = dict(train.get_clients(ids))
      cut = slice(0, max_examples or None)
      return [(ids[i % len(ids)] + (f'#{i}'.encode() if i >= len(ids) else
                                    b''), writers[ids[i % len(ids)]][cut])
              for i in range(max(cohort, len(ids)))], 'real FEMNIST'
  rng = np.random.RandomState(seed)
  median, sigma, lo, hi = ((200, 0.45, 8, 500) if model == 'femnist' else
                           (48, 1.0, 1, 256))
  counts = np.clip(np.round(median * np.exp(sigma * rng.standard_normal(
      max(4 * cohort, 1000)))), lo, min(hi, max_examples or hi)).astype(int)
  if model == 'femnist':
    pool = {'x': rng.uniform(0, 1, (1024, 28, 28, 1)).astype(np.float32),
            'y': rng.randint(0, 62, 1024).astype(np.int32)}
  else:
    tokens = rng.randint(4, LM_VOCAB, (1024, LM_LENGTH + 1)).astype(np.int32)
    pool = {'x': tokens[:, :-1], 'y': tokens[:, 1:]}
  starts = [rng.randint(0, 1024 - n + 1) for n in counts]
  return [(f'synthetic{i:05d}'.encode(), fedjax.ClientDataset(
      {k: v[s:s + n] for k, v in pool.items()}))
          for i, (s, n) in enumerate(zip(starts, counts))], 'synthetic'


def fresh_cohort(clients: list, cohort: int, seed: int, round_num: int
                 ) -> list:
  """Round ``round_num``'s cohort: ``cohort`` clients drawn without
  replacement, with their PRNG keys (the runner's ``client_rngs``)."""
  pick = np.random.RandomState([seed, round_num]).choice(
      len(clients), size=cohort, replace=False)
  keys = client_rngs(seed, round_num, [clients[i][0] for i in pick])
  return [(clients[i][0], clients[i][1], key) for i, key in zip(pick, keys)]


def device_name() -> str:
  kind = jax.devices()[0].device_kind
  return re.sub(r'[^a-z0-9]+', '_', kind.lower()).strip('_') or 'device'


def peak_memory_bytes() -> tuple[int, str]:
  """(bytes, source): the device allocator's peak, else the process peak RSS."""
  try:
    stats = jax.devices()[0].memory_stats()
  except Exception:  # pylint: disable=broad-except  # Backends without stats.
    stats = None
  if stats and 'peak_bytes_in_use' in stats:
    return int(stats['peak_bytes_in_use']), 'device peak_bytes_in_use'
  return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
          'process peak RSS')


def _model(name: str, engine: str = 'loop', dtype: str = 'float32',
           conv: str = 'auto') -> fedjax.Model:
  """The model; the CNN's convolutions ``conv`` ('auto': im2col where
  vmapped, as the runner); FedJAX's jit reference float32 and lax."""
  compute = None if dtype == 'float32' or engine == 'fedjax_jit' else dtype
  if name != 'femnist':
    return lm.create_lm(name, LM_VOCAB, compute_dtype=compute).model
  if conv == 'auto' or engine == 'fedjax_jit':
    conv = 'im2col' if engine in ('vmap', 'fedjax_vmap') else 'lax'
  return models.create_emnist_cnn(62, conv_implementation=conv,
                                  compute_dtype=compute).model


def _algorithm(engine: str, model: fedjax.Model, batch_size: int, args):
  grad_fn = fedjax.model_grad(model)
  if engine in ('loop', 'vmap'):
    options = {} if engine == 'loop' else dict(
        segment_steps=args.segment_steps, **{
            k: v if v == 'auto' else int(v) for k, v in (
                ('lanes_per_device', args.lanes_per_device),
                ('slots', args.slots))})
    return federated_averaging(
        grad_fn, optax.sgd(0.1), optax.sgd(1.0),
        fedjax.ShuffleRepeatBatchHParams(batch_size=batch_size),
        engine=engine, **options)
  backend = 'jit' if engine == 'fedjax_jit' else VmapBackend()
  with fedjax.for_each_client_backend(backend):  # Bound when built.
    return fedjax.algorithms.fed_avg.federated_averaging(
        grad_fn, fedjax.optimizers.sgd(0.1), fedjax.optimizers.sgd(1.0),
        fedjax.ShuffleRepeatBatchHParams(batch_size=batch_size, seed=0))


def estimate_seconds(last: Optional[tuple[int, float, float]], cohort: int,
                     rounds: int) -> float:
  """Expected seconds of a cohort's run from the last cohort's ``(cohort,
  s/round, compile s)``: compile s + s/round x cohort ratio x rounds; 0.0
  without one (the first cohort always runs)."""
  return last[2] + last[1] * cohort / last[0] * rounds if last else 0.0


def skip_reason(estimate: float, max_seconds: float, now: float,
                deadline: float) -> Optional[str]:
  """Why a cohort estimated at ``estimate`` s is not run (None: it runs)."""
  if estimate > max_seconds:
    return f'estimated {estimate:.0f} s > --max_seconds={max_seconds:g}'
  if now + estimate > deadline:
    return 'over the run\'s --total_seconds budget'
  return None


def _timed_rounds(args, alg, params, clients, row: dict, batch_size: int):
  """The timed rounds of ``row``'s cohort; their numbers into ``row``."""
  state = alg.init(params)
  walls, useful, executed, sequential = [], [], [], []
  start = time.perf_counter()
  with stats_lib.recording_stats() as rec, \
      stats_lib.counting_compilations() as compiles:
    for r in range(args.rounds):
      work = fresh_cohort(clients, row['cohort'], args.seed, r)
      useful.append(sum(-(-len(cds) // batch_size) for _, cds, _ in work))
      t0 = time.perf_counter()
      state, _ = alg.apply(state, work)
      jax.block_until_ready(state.params)
      walls.append(time.perf_counter() - t0)
      counts = rec.take()
      if counts['clients'] and counts['useful_steps'] != useful[-1]:
        raise AssertionError(f'engine counted {counts["useful_steps"]} '
                             f'useful steps, expected {useful[-1]}')
      # FedJAX's jit backend counts nothing: one call per useful step.
      executed.append(counts['executed_steps'] or useful[-1])
      sequential.append(counts['sequential_steps'] or useful[-1])
      row.update((k, counts[k]) for k in ('lanes', 'segment_steps')
                 if counts.get(k) is not None)
      if r == 0:
        first = compiles.total
      if 1 <= r < args.rounds - 1 and (
          time.perf_counter() - start + walls[-1] > args.max_seconds
          or time.time() + walls[-1] > (args.deadline or math.inf)):
        break
  row.update(
      rounds=len(walls), s_per_round=statistics.median(walls[1:] or walls),
      first_round_s=walls[0], run_s=time.perf_counter() - start,
      compilations=compiles.total, later_compilations=compiles.total - first,
      client_program_compilations=compiles.count(*stats_lib.CLIENT_PROGRAMS),
      compile_s=compiles.total_seconds,
      compile_s_by_program={k: round(v, 3) for k, v in
                            compiles.seconds.most_common(6)},
      useful_steps=float(np.mean(useful)),
      executed_steps=float(np.mean(executed)),
      sequential_steps=float(np.mean(sequential)))
  return state


def run_worker(args, on_row) -> None:
  """Rows of one (model, engine, dtype) over the cohorts, ascending, each
  passed to ``on_row`` when done."""
  name, engine, dtype = args.models, args.engines, args.compute_dtype
  batch_size = FEMNIST_BATCH if name == 'femnist' else LM_BATCH
  model = _model(name, engine, dtype, conv=args.conv_implementation)
  params = model.init(jax.random.PRNGKey(args.seed))
  last, failed = None, None
  for cohort in sorted(args.cohorts):
    row = {'model': name, 'engine': engine, 'dtype': dtype, 'cohort': cohort}
    why = failed or skip_reason(estimate_seconds(last, cohort, args.rounds),
                                args.max_seconds, time.time(),
                                args.deadline or math.inf)
    clients, row['data'] = population(name, cohort, args.seed,
                                      args.max_examples, args.data_dir)
    if why or cohort > len(clients):
      on_row({**row, 'skip': why or f'{len(clients)} clients in all'})
      continue
    try:
      alg = _algorithm(engine, model, batch_size, args)
      done = dict(row)
      state = _timed_rounds(args, alg, params, clients, done, batch_size)
      done['peak_mem_bytes'], done['mem_source'] = peak_memory_bytes()
      if args.profile:
        done.update(profile_rounds(args, alg, state, clients, done))
    except Exception as err:  # pylint: disable=broad-except
      text = f'{type(err).__name__}: {err}'.splitlines()[0][:200]
      on_row({**row, 'skip': ('out of memory: ' if 'RESOURCE_EXHAUSTED' in
                              text else '') + text})
      failed = f'not run: failed at cohort {cohort}'
      continue
    last = (cohort, done['s_per_round'], done['compile_s'])
    on_row(done)


def profile_rounds(args, alg, state, clients, row: dict) -> dict[str, Any]:
  """``--profile_rounds`` more rounds traced into ``<profile_dir>/<row>/``,
  their summary in ``<row>.json``; the row's fields of it."""
  stem = os.path.join(args.profile_dir, '_'.join(
      str(row[k]) for k in ('model', 'engine', 'dtype', 'cohort')))
  cohorts = [fresh_cohort(clients, row['cohort'], args.seed, args.rounds + r)
             for r in range(args.profile_rounds)]
  _, walls, path, compiled = trace_summary.traced_rounds(alg, state, cohorts,
                                                         stem)
  summary = trace_summary.summarize(trace_summary.load_events(path))
  summary.update(host_round_s=walls, compilations=compiled, trace_file=path)
  pathlib.Path(stem + '.json').write_text(json.dumps(summary, indent=1))
  print('\n'.join(trace_summary.summary_lines(summary)), flush=True)
  lanes = row['engine'] in ('vmap', 'fedjax_vmap')
  return {'profile': stem + '.json', 'outside_segment_s':
          summary['outside_segment_per_round_s'] if lanes else None}


#: Flags a configuration's process gets from the parent's.
_PASSED = ('models', 'engines', 'compute_dtype', 'cohorts', 'rounds',
           'max_seconds', 'lanes_per_device', 'segment_steps', 'slots',
           'conv_implementation', 'max_examples', 'seed', 'profile_rounds',
           'profile_dir', 'data_dir', 'compilation_cache_dir')


def _run_isolated(args, budget: float, on_row) -> None:
  """:func:`run_worker` in its own process (rows as it prints them), killed
  after ``budget`` + 60 s; the rows it did not finish are skips. It stays
  in this process group: ``timeout`` ends both."""
  cmd = [sys.executable, os.path.abspath(__file__), '--worker',
         f'--deadline={time.time() + budget:.0f}',
         '--profile' if args.profile else '--no-profile'] + [
             f'--{k}={",".join(map(str, v)) if isinstance(v, list) else v}'
             for k in _PASSED if (v := getattr(args, k)) is not None]
  done = set()
  with tempfile.TemporaryFile('w+') as err:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err,
                            text=True)
    timer = threading.Timer(budget + 60, proc.kill)
    timer.start()
    try:
      for line in proc.stdout:
        if line.startswith('ROW '):
          row = json.loads(line[4:])
          done.add(row['cohort'])
          on_row(row)
        else:
          print(line, end='', flush=True)
      code = proc.wait()
    finally:
      timer.cancel()
    err.seek(0)
    tail = (err.read().strip().splitlines() or ['no output'])[-1][:160]
  for c in sorted(set(args.cohorts) - done):
    on_row({'model': args.models, 'engine': args.engines,
            'dtype': args.compute_dtype, 'cohort': c,
            'skip': f'process exited {code}: {tail}' if code != -9 else
            f'process killed after {budget + 60:.0f} s'})


TABLE_HEAD = (
    '| model | engine | dtype | cohort | s/round | vs FedJAX jit | vs loop '
    '| run s (rounds) | compilations (client programs; after round 1) '
    '| compile s | peak mem (MiB) | lanes | sequential steps '
    '| executed / useful | outside lanes_segment s (profiled) |\n'
    '|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:'
    '|---:|')


def _ratio(rows: list[dict], row: dict, engine: str) -> str:
  """``engine``'s s/round / the row's at the same model and cohort (and
  dtype, against the loop engine)."""
  for r in rows:
    if (r['engine'] == engine and 'skip' not in r and 'skip' not in row
        and (r['model'], r['cohort']) == (row['model'], row['cohort'])
        and (engine == 'fedjax_jit' or r['dtype'] == row['dtype'])):
      return f'{r["s_per_round"] / row["s_per_round"]:.2f}x'
  return ''


def table_row(rows: list[dict], row: dict) -> str:
  head = (f'| {row["model"]} | {row["engine"]} | {row["dtype"]} |'
          f' {row["cohort"]:,} |')
  if 'skip' in row:
    return head + f' skipped: {row["skip"]} |' + ' |' * 10
  cells = [f'{row["s_per_round"]:.3g}', _ratio(rows, row, 'fedjax_jit'),
           _ratio(rows, row, 'loop'), f'{row["run_s"]:.3g} ({row["rounds"]})',
           f'{row["compilations"]} ({row["client_program_compilations"]}; '
           f'{row["later_compilations"]})', f'{row["compile_s"]:.3g}',
           f'{row["peak_mem_bytes"] / 2**20:,.0f}', str(row.get('lanes', '')),
           f'{row["sequential_steps"]:,.1f}',
           f'{row["executed_steps"] / row["useful_steps"]:.2f}x',
           '' if row.get('outside_segment_s') is None else
           f'{row["outside_segment_s"]:.3g}']
  return head + ''.join(f' {c} |' for c in cells)


def write_report(output: str, header: list[str], rows: list[dict]) -> None:
  """Header bullets, the table, each row's compile seconds by program and
  profile; the rows as JSON."""
  done = [r for r in rows if 'skip' not in r]
  notes = [f'{r["model"]} {r["engine"]} {r["dtype"]} {r["cohort"]}: data '
           f'{r["data"]}, first round {r["first_round_s"]:.3g} s, compile '
           's by program: ' + ', '.join(
               f'{k} {v:.3g}' for k, v in r['compile_s_by_program'].items())
           + (f'; profile {r["profile"]}' if 'profile' in r else '')
           for r in done]
  pathlib.Path(output).parent.mkdir(parents=True, exist_ok=True)
  pathlib.Path(output).write_text('\n'.join(
      ['# Round engines against FedJAX: bench_rounds.py', ''] +
      [f'- {h}' for h in header] + ['', TABLE_HEAD] +
      [table_row(rows, r) for r in rows] + [''] + [f'- {n}' for n in notes] +
      ['', '<!-- rows: ' + json.dumps(rows) + ' -->', '']))


def _machine() -> str:
  devs = jax.devices()
  return (f'{len(devs)} x {devs[0].device_kind} ({jax.default_backend()}), '
          f'{os.cpu_count()} CPU threads; jax {jax.__version__}, fedjax '
          f'{importlib.metadata.version("fedjax")}, python '
          f'{platform.python_version()}')


def _parse(argv) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add = p.add_argument
  add('--models', help=f'comma list of {", ".join(MODELS)} (default: '
      'femnist,lstm_small,transformer_large; femnist,lstm_tiny,'
      'transformer_tiny on CPU)')
  add('--engines', default=','.join(ENGINES), help='comma list')
  add('--compute_dtype', default='float32',
      help='comma list of float32, bfloat16 (FedJAX jit: float32)')
  add('--cohorts', help='comma list (default 10,100,1000; 10 on CPU)')
  add('--rounds', type=int, help='fresh cohorts (default 5; 4 on CPU)')
  add('--lanes_per_device', default='auto', help='vmap engine')
  add('--segment_steps', type=int, default=4, help='vmap engine')
  add('--slots', default='auto', help='vmap engine')
  add('--conv_implementation', default='auto',
      choices=('auto',) + layers.CONV_IMPLEMENTATIONS)
  add('--data_dir', help='FEMNIST data (default $FEDLITE_DATA_DIR)')
  add('--max_examples', type=int, default=0, help='per client (0: all)')
  add('--seed', type=int, default=0)
  add('--max_seconds', type=float, help='per configuration (default 150; '
      '300 on CPU)')
  add('--total_seconds', type=float, help='whole run (default 1800; 3600 '
      'on CPU)')
  add('--output', help='default benchmarks/results/rounds_<device>.md; '
      '"-": none')
  add('--isolate', default=True, action=argparse.BooleanOptionalAction)
  add('--profile', default=False, action=argparse.BooleanOptionalAction)
  add('--profile_rounds', type=int, default=1)
  add('--profile_dir', help='default <output>_profiles/')
  add('--compilation_cache_dir', help='JAX\'s persistent cache (default off)')
  add('--worker', action='store_true', help=argparse.SUPPRESS)
  add('--deadline', type=float, default=0, help=argparse.SUPPRESS)
  args = p.parse_args(argv)
  cpu = jax.default_backend() == 'cpu'
  args.models = args.models or ('femnist,lstm_tiny,transformer_tiny' if cpu
                                else 'femnist,lstm_small,transformer_large')
  args.cohorts = [int(c) for c in str(
      args.cohorts or ('10' if cpu else '10,100,1000')).split(',')]
  args.rounds = args.rounds or (4 if cpu else 5)
  args.max_seconds = args.max_seconds or (300.0 if cpu else 150.0)
  args.total_seconds = args.total_seconds or (3600.0 if cpu else 1800.0)
  for flag, allowed in (('models', MODELS), ('engines', ENGINES),
                        ('compute_dtype', DTYPES)):
    for v in getattr(args, flag).split(','):
      if v not in allowed:
        raise SystemExit(f'--{flag}: {v!r} is not one of '
                         f'{", ".join(allowed)}.')
  for flag in ('lanes_per_device', 'slots'):
    v = getattr(args, flag)
    if v != 'auto' and not (v.isdigit() and int(v) >= 1):
      raise SystemExit(f"--{flag} must be 'auto' or an int >= 1; got {v!r}.")
  if min(args.cohorts) < 1 or args.rounds < 1 or args.profile_rounds < 1:
    raise SystemExit('--cohorts, --rounds and --profile_rounds must be >= 1;'
                     f' got {args.cohorts}, {args.rounds}, '
                     f'{args.profile_rounds}.')
  return args


def main(argv: Optional[list[str]] = None) -> list[dict]:
  args = _parse(argv)
  cache = args.compilation_cache_dir
  jax.config.update('jax_enable_compilation_cache', bool(cache))
  if cache:
    jax.config.update('jax_compilation_cache_dir', cache)
    jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  compilation_cache.reset_cache()  # In case an import compiled already.
  rows: list[dict] = []
  if args.worker:
    run_worker(args, lambda r: print('ROW ' + json.dumps(r), flush=True))
    return rows
  output = args.output or os.path.join(os.path.dirname(os.path.abspath(
      __file__)), 'results', f'rounds_{device_name()}.md')
  if args.profile:
    args.profile_dir = args.profile_dir or (
        tempfile.mkdtemp(prefix='bench_rounds_') if output == '-' else
        os.path.splitext(output)[0] + '_profiles')
    os.makedirs(args.profile_dir, exist_ok=True)
  command = ' '.join(['python benchmarks/bench_rounds.py'] + (
      sys.argv[1:] if argv is None else list(argv)))
  header = [f'command: `{command}`', f'machine: {_machine()}',
            f'{args.rounds} rounds on fresh cohorts (s/round: median after '
            'the first); lanes_per_device, segment_steps, slots: '
            f'{args.lanes_per_device}, {args.segment_steps}, {args.slots}']
  print('\n'.join(header) + '\n' + TABLE_HEAD, flush=True)

  def on_row(row: dict) -> None:
    rows.append(row)
    print(table_row(rows, row), flush=True)
    if output != '-':  # A killed run keeps the rows it finished.
      write_report(output, header, rows)

  engines = args.engines.split(',')
  engines = ([e for e in REFERENCE_ENGINES if e in engines] +
             [e for e in engines if e not in REFERENCE_ENGINES])
  configs = [argparse.Namespace(**{**vars(args), 'models': m, 'engines': e,
                                   'compute_dtype': d})
             for m in args.models.split(',') for e in engines
             for d in (['float32'] if e == 'fedjax_jit' else
                       args.compute_dtype.split(','))]
  end = time.time() + args.total_seconds
  for i, sub in enumerate(configs):
    if args.isolate:  # A fair share of the time left.
      _run_isolated(sub, max(end - time.time(), 0) / (len(configs) - i),
                    on_row)
    else:
      sub.deadline = end
      run_worker(sub, on_row)
  if output != '-':
    print(f'wrote {output}')
  return rows


if __name__ == '__main__':
  main()
