"""Measures how far results files' check runs move with the float order.

A results file's ``check`` (``experiments/results/*.json``) is one short run
whose evaluation curve ``tests/test_experiment_results.py`` re-runs and
compares. XLA:CPU sums float32 values in an order that depends on the host
(vector width, thread count, fusion), and runs with stochastic rounding
(``uniform_quantization``, ``terngrad``; distributed DP's conditional
randomized rounding, ``ddgauss``, ``skellam``) turn a last-bit difference into a
different rounding draw, so their loss and accuracy move on another machine of
the same kind. This re-runs each check's command under several float orders
(``ORDERS``: default; one core with Eigen single-threaded; the vector ISA capped
at AVX2; capped at SSE4.2), records per order the deviation from the recorded
curve (loss relative; accuracy in evaluated examples or tokens, i.e.
``|accuracy - recorded| x count``; bytes must be equal) and writes into the
file's ``check``:

* ``spread``: the deviation per order, its maximum, the count of evaluated
  examples / tokens and where it comes from, the machine and commit;
* ``tolerance``: ``FACTOR`` x the largest deviation, floored at float noise
  (``FLOAT_NOISE``: loss relative 1e-5, accuracy 1 example / token);

and a ``check tolerance: ...`` line at the end of the file's ``.md``. A
script's own per-row check (``rows``: ``igc_privacy.py --check``'s PSNR and
best attack loss per row) is run under every order (its attack iterations
amplify a last-bit difference) and gets a relative tolerance per row
and key. A check
whose command has no stochastic rounding is deterministic up to float noise:
it keeps the floor, and unless ``--measure_deterministic`` its spread says so
without runs. ``CROSS_MACHINE`` holds deviations measured on another machine
of the same kind (they count as measured spread). Usage (repository root,
``FEDLITE_DATA_DIR`` set; runs are serial, under ``nice -n 10``)::

  python experiments/measure_check_spread.py \
      --files=efficient_lm.json,lm_seeds.json --orders=default,one_core,avx2
"""

from __future__ import annotations

import datetime
import json
import math
import os
import pathlib
import platform
import shlex
import subprocess
import sys
from typing import Any, Mapping, Sequence

from absl import app
from absl import flags

import provenance
import stats

FLAGS = flags.FLAGS
flags.DEFINE_list('files', ['efficient_lm.json', 'lm_seeds.json'],
                  'Results files under experiments/results/ to measure.')
flags.DEFINE_list('orders', ['default', 'one_core', 'avx2', 'sse4_2'],
                  'Float orders to run (keys of ORDERS).')
flags.DEFINE_string('work_dir', '/tmp/fedlite_check_spread',
                    'Where the runs write (<work_dir>/<file>/<order>).')
flags.DEFINE_bool('reuse', False, 'Reuse a finished run of an order found in '
                  '--work_dir instead of running it again.')
flags.DEFINE_bool('measure_deterministic', False, 'Also run checks without '
                  'stochastic rounding (else marked float noise, no runs).')
flags.DEFINE_bool('write', True, 'Write spread/tolerance into the files.')

FACTOR = provenance.TOLERANCE_FACTOR
FLOAT_NOISE = provenance.FLOAT_NOISE
STOCHASTIC = ('uniform_quantization', 'terngrad', 'stochastic', 'ddgauss',
              'skellam')
# name: (environment, command prefix, description).
ORDERS = {
    'default': ({}, [], 'default (all cores, the host ISA)'),
    'one_core': ({'XLA_FLAGS': '--xla_cpu_multi_thread_eigen=false '
                               'intra_op_parallelism_threads=1'},
                 ['taskset', '-c', '0'],
                 'one core (taskset -c 0, --xla_cpu_multi_thread_eigen=false '
                 'intra_op_parallelism_threads=1)'),
    'avx2': ({'XLA_FLAGS': '--xla_cpu_max_isa=AVX2'}, [],
             '--xla_cpu_max_isa=AVX2'),
    'sse4_2': ({'XLA_FLAGS': '--xla_cpu_max_isa=SSE4_2'}, [],
               '--xla_cpu_max_isa=SSE4_2'),
}
# Values a check gave on another machine of the same kind (2 cores, same
# pinned wheels), where tests/test_experiment_results.py failed at float noise.
CROSS_MACHINE = {
    'efficient_lm.json': {'order': 'another 2-core machine, same pinned '
                                   'wheels', 'round': 5,
                          'got': {'accuracy': 0.0275227}},
    'lm_seeds.json': {'order': 'another 2-core machine, same pinned wheels',
                      'round': 5,
                      'got': {'loss': 6.539448}},
}
# Test-set sizes of tasks whose evaluation rows carry no count, when every
# test client is evaluated (--eval_num_clients=0): FEMNIST-105's test split.
TEST_EXAMPLES = {'emnist': 1685}
# The .md beside a results file, where it is not <file>.md.
MARKDOWN = {'fedlite_results.json': 'fedlite_tables.md'}
_COUNT_KEYS = ('num_tokens', 'num_examples', 'eval/num_examples')
# Values of a script's own per-row check (igc_privacy.py --check).
ROW_KEYS = ('psnr', 'best_loss')


def command_flags(command: str) -> dict[str, str]:
  """``--name=value`` flags of a check command, flagfile lines included
  (the command's own flags win)."""
  argv = shlex.split(command)[2:]
  out: dict[str, str] = {}
  for a in argv:
    if a.startswith('--flagfile='):
      for line in (provenance.REPO / a.split('=', 1)[1]).read_text(
          ).splitlines():
        if line.startswith('--'):
          k, _, v = line[2:].partition('=')
          out.setdefault(k, v)
  for a in argv:
    k, _, v = a[2:].partition('=')
    out[k] = v
  return out


def is_stochastic(command: str) -> bool:
  """Whether a check command (with its flagfile) rounds stochastically."""
  text = ' '.join(f'{k}={v}' for k, v in command_flags(command).items())
  return any(s in text for s in STOCHASTIC)


def _lm_accuracy_tokens(row: Mapping[str, Any]) -> float | None:
  """Targets the LM ``accuracy`` counts (not PAD, EOS or OOV), or None.

  ``accuracy`` = c / D over targets that are not PAD, EOS or OOV and
  ``accuracy_no_eos`` = c / (D + oov) with the OOV targets back in
  (``fedlite_jax.models.lm.lm_eval_metrics``; an OOV target is never
  predicted, so c is the same), oov = ``token_oov_rate`` x ``num_tokens``:
  D ~ accuracy_no_eos x oov / (accuracy - accuracy_no_eos): the integer
  nearest it that makes both accuracies whole counts.
  """
  try:
    acc, acc_ne = row['accuracy'], row['accuracy_no_eos']
    oov = round(row['token_oov_rate'] * row['num_tokens'])
    est = acc_ne * oov / (acc - acc_ne)
  except (KeyError, ZeroDivisionError):
    return None
  whole = lambda x: abs(x - round(x)) < 1e-3
  # float32 accuracies put the estimate within a few tokens of D.
  fits = [d for d in range(max(1, round(est) - 50), round(est) + 51)
          if whole(acc * d) and whole(acc_ne * (d + oov))]
  return float(min(fits, key=lambda d: abs(d - est))) if fits else None


def eval_count(check: Mapping[str, Any]) -> tuple[float, str]:
  """Examples / tokens one evaluation's accuracy counts, and its source."""
  row = check['curve'][-1]
  d = _lm_accuracy_tokens(row)
  if d is not None:
    return d, (f'tokens the accuracy counts: not PAD, EOS or OOV ({d:,.0f} '
               f'of the {row["num_tokens"]:,.0f} num_tokens: the integer D near '
               'accuracy_no_eos x oov / (accuracy - accuracy_no_eos), '
               'oov = token_oov_rate x num_tokens, with accuracy x D and '
               'accuracy_no_eos x (D + oov) whole)')
  for key in _COUNT_KEYS:
    if key in row:
      return float(row[key]), f'"{key}" of the check\'s evaluation row'
  f = command_flags(check['command'])
  task, clients = f.get('task'), f.get('eval_num_clients')
  if task not in TEST_EXAMPLES or clients != '0':
    raise app.UsageError(f'{check["command"]}: no evaluation count in its '
                         'rows and not a full test set of a task in '
                         f'TEST_EXAMPLES ({sorted(TEST_EXAMPLES)}).')
  n = TEST_EXAMPLES[task]
  for r in check['curve']:  # Accuracy x n must count whole examples.
    if abs(r['accuracy'] * n - round(r['accuracy'] * n)) > 1e-3:
      raise app.UsageError(f'accuracy {r["accuracy"]} x {n} is not whole')
  return float(n), (f'examples of the {task} test set (--eval_num_clients=0 '
                    f'evaluates all {n:,} test examples; accuracy x {n:,} is '
                    'whole)')


def deviation(rows: Sequence[Mapping], curve: Sequence[Mapping],
              n: float) -> dict[str, Any]:
  """Largest deviation of ``rows`` from the recorded ``curve``."""
  if [r['round'] for r in rows] != [r['round'] for r in curve]:
    raise RuntimeError(f'rounds {[r["round"] for r in rows]} differ from '
                       f'the check\'s {[r["round"] for r in curve]}')
  loss = acc = 0.0
  equal = True
  for got, want in zip(rows, curve):
    loss = max(loss, abs(got['loss'] - want['loss']) / abs(want['loss']))
    # float32 accuracies (and 6-digit reports): a whole count to 0.01.
    acc = max(acc, round(abs(got['accuracy'] - want['accuracy']) * n, 2))
    equal &= all(got[k] == want[k] for k in ('upload_bytes', 'download_bytes')
                 if k in want)
  return {'loss_rel': loss, 'accuracy_examples': acc, 'bytes_equal': equal,
          'final': {k: rows[-1][k] for k in ('loss', 'accuracy')}}


def run_order(name: str, command: str, order: str) -> list[dict]:
  """Runs ``command`` under ``order``; its evaluation rows."""
  out = _run(name, command, order, ('summary.json', 'metrics.jsonl'))
  rows = [json.loads(line) for line in (out / 'metrics.jsonl').read_text(
      ).splitlines() if line.strip()]
  return stats.eval_rows(rows)


def run_rows_order(name: str, command: str, order: str) -> list[dict]:
  """Runs a script's own check ``command`` under ``order``; its rows
  (``<output_dir>/check.json``, e.g. ``igc_privacy.py --check``)."""
  out = _run(name, command, order, ('check.json',))
  return json.loads((out / 'check.json').read_text())['rows']


def _run(name: str, command: str, order: str,
         outputs: Sequence[str]) -> pathlib.Path:
  """Runs ``command`` under ``order`` into ``<work_dir>/<file>/<order>``
  (reused under ``--reuse`` when ``outputs`` exist there); that folder."""
  env_add, prefix, _ = ORDERS[order]
  out = pathlib.Path(FLAGS.work_dir) / pathlib.Path(name).stem / order
  argv = shlex.split(command)
  if FLAGS.reuse and all((out / o).exists() for o in outputs):
    print(f'{name} {order}: reusing {out}', flush=True)
  else:
    argv = ['nice', '-n', '10', *prefix, sys.executable] + [
        f'--output_dir={out}' if a.startswith('--output_dir=') else a
        for a in argv[1:]]
    env = {**os.environ, 'PYTHONPATH': str(provenance.REPO)}
    for k, v in env_add.items():
      env[k] = f'{env.get(k, "")} {v}'.strip()
    print(f'{name} {order}: {" ".join(argv)}', flush=True)
    subprocess.run(argv, cwd=provenance.REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL)
  return out


def machine() -> str:
  """One line naming the host: CPU, cores, ISA, platform, JAX."""
  import jax  # pylint: disable=g-import-not-at-top
  cpu, isa = platform.processor() or platform.machine(), ''
  try:
    info = pathlib.Path('/proc/cpuinfo').read_text()
    cpu = next(l.split(':', 1)[1].strip() for l in info.splitlines()
               if l.startswith('model name'))
    isa = 'AVX-512' if ' avx512f' in info else (
        'AVX2' if ' avx2' in info else 'no AVX2')
  except (OSError, StopIteration):
    pass
  return (f'{cpu}, {os.cpu_count()} cores, {isa}; {platform.platform()}; '
          f'Python {platform.python_version()}, JAX {jax.__version__}')


def _up(x: float) -> float:
  """``x`` rounded up to two significant digits."""
  if x <= 0:
    return 0.0
  step = 10 ** (math.floor(math.log10(x)) - 1)
  up = round(math.ceil(round(x / step, 6)) * step, 12)
  return up if up >= x else round(up + step, 12)


def tolerance(spread: Mapping[str, Any]) -> dict[str, Any]:
  """``FACTOR`` x the spread (rounded up), floored at ``FLOAT_NOISE``."""
  if 'rows' in spread:  # A per-row check: per row and key, relative.
    return {'rows': {run: {k: max(FLOAT_NOISE['loss_rel'], _up(FACTOR * v))
                           for k, v in d.items()}
                     for run, d in spread['rows'].items()},
            'factor': FACTOR, 'floor': FLOAT_NOISE['loss_rel']}
  return {'loss_rel': max(FLOAT_NOISE['loss_rel'],
                          _up(FACTOR * spread['loss_rel'])),
          'accuracy_examples': max(FLOAT_NOISE['accuracy_examples'],
                                   _up(FACTOR * spread['accuracy_examples'])),
          'bytes': 'exact', 'factor': FACTOR, 'floor': dict(FLOAT_NOISE),
          'count': spread['count']}


def rows_deviation(got: Sequence[Mapping], want: Sequence[Mapping]
                   ) -> dict[str, Any]:
  """Relative deviation per row and key (``ROW_KEYS``) of a per-row check:
  ``{'rows': {run: {'<key>_rel': ...}}, 'got': {run: {key: values}}}``."""
  if [r['run'] for r in got] != [r['run'] for r in want]:
    raise RuntimeError(f'rows {[r["run"] for r in got]} differ from the '
                       f'check\'s {[r["run"] for r in want]}')
  return {'rows': {w['run']: {f'{k}_rel': max(
      abs(a - b) / abs(b) for a, b in zip(g[k], w[k])) for k in ROW_KEYS}
                   for g, w in zip(got, want)},
          'got': {r['run']: {k: r[k] for k in ROW_KEYS} for r in got}}


def measure_rows(name: str, check: Mapping[str, Any],
                 orders: Sequence[str]) -> dict[str, Any]:
  """The spread of a per-row check, every order run (an attack's iterations
  amplify a last-bit difference, so no check of this kind is exact): per
  row and key the largest deviation over the orders."""
  per = {}
  for order in orders:
    per[order] = {'description': ORDERS[order][2], **rows_deviation(
        run_rows_order(name, check['command'], order), check['rows'])}
    print(f'{name} {order}: {per[order]["rows"]}', flush=True)
  return {'rows': {r['run']: {f'{k}_rel': max(
      d['rows'][r['run']][f'{k}_rel'] for d in per.values())
                              for k in ROW_KEYS} for r in check['rows']},
          'orders': per, 'machine': machine(), **provenance.git_state(),
          'date': datetime.datetime.now(datetime.timezone.utc).strftime(
              '%Y-%m-%dT%H:%M:%SZ')}


def measure(name: str, orders: Sequence[str]) -> dict[str, Any]:
  """The spread of ``name``'s check (running its orders when stochastic)."""
  check = json.loads((_results() / name).read_text())['check']
  if 'rows' in check:
    return measure_rows(name, check, orders)
  n, source = eval_count(check)
  stochastic = is_stochastic(check['command'])
  per: dict[str, Any] = {}
  if stochastic or FLAGS.measure_deterministic:
    for order in orders:
      per[order] = {'description': ORDERS[order][2], **deviation(
          run_order(name, check['command'], order), check['curve'], n)}
      print(f'{name} {order}: {per[order]}', flush=True)
  if name in CROSS_MACHINE:
    ext = CROSS_MACHINE[name]
    want = next(r for r in check['curve'] if r['round'] == ext['round'])
    per['cross_machine'] = {'description': ext['order'], 'got': ext['got'],
                            'loss_rel': abs(ext['got'].get('loss', want['loss'])
                                            - want['loss']) / want['loss'],
                            'accuracy_examples': round(abs(ext['got'].get(
                                'accuracy', want['accuracy'])
                                                           - want['accuracy'])
                                                       * n, 2),
                            'bytes_equal': True}
  bad = [o for o, d in per.items() if not d['bytes_equal']]
  if bad:
    raise RuntimeError(f'{name}: bytes differ under {bad}; bytes get no '
                       'tolerance: find the cause')
  spread = {
      'stochastic_rounding': stochastic,
      'loss_rel': max([d['loss_rel'] for d in per.values()], default=0.0),
      'accuracy_examples': max([d['accuracy_examples'] for d in per.values()],
                               default=0.0),
      'count': n, 'count_source': source, 'orders': per,
      'machine': machine(), **provenance.git_state(),
      'date': datetime.datetime.now(datetime.timezone.utc).strftime(
          '%Y-%m-%dT%H:%M:%SZ')}
  if not per:
    spread['note'] = ('deterministic: not measured beyond the default order '
                      '(no stochastic rounding in the command; float-noise '
                      'tolerance)')
  return spread


def _results() -> pathlib.Path:
  return provenance.REPO / provenance.RESULTS_DIR


md_line = provenance.tolerance_md_line


def write(name: str, spread: dict[str, Any]) -> str:
  """Writes spread and tolerance into ``name``'s check and its .md line."""
  path = _results() / name
  data = json.loads(path.read_text())
  tol = tolerance(spread)
  data['check']['spread'] = spread
  data['check']['tolerance'] = tol
  path.write_text(json.dumps(data, indent=1) + '\n')
  line = md_line(spread, tol)
  md = path.parent / MARKDOWN.get(name, path.with_suffix('.md').name)
  if md.exists():
    lines = [l for l in md.read_text().splitlines()
             if not l.startswith('check tolerance:')]
    while lines and not lines[-1].strip():
      lines.pop()
    md.write_text('\n'.join(lines + ['', line]) + '\n')
  return line


def main(argv):
  del argv
  bad = [o for o in FLAGS.orders if o not in ORDERS]
  if bad:
    raise app.UsageError(f'--orders: {bad} not in {sorted(ORDERS)}')
  for name in FLAGS.files:
    spread = measure(name, FLAGS.orders)
    print(f'{name}: spread ' + str(spread['rows'] if 'rows' in spread else {
        k: spread[k] for k in ('loss_rel', 'accuracy_examples', 'count')}),
          flush=True)
    if FLAGS.write:
      print(f'{name}: {write(name, spread)}', flush=True)


if __name__ == '__main__':
  app.run(main)
