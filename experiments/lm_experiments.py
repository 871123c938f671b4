#!/usr/bin/env python3
"""Small-scale efficient-LM experiments on real Shakespeare (Ro et al. 2022).

Writes ``experiments/results/efficient_lm.md`` and ``efficient_lm.png`` (and
one JSON per run under ``experiments/results/efficient_lm_runs/``; existing
run files are reused unless ``--rerun``; the pretrained parameters go to
``runs/pretrain/``):

  python experiments/lm_experiments.py                 # all runs
  python experiments/lm_experiments.py --only=fedadam,upload8 --rounds=100
  python experiments/lm_experiments.py --groups=grid    # Figure 5 grid only
  python experiments/lm_experiments.py --report_only   # tables/plots only

Groups (``--groups``, any of): quant, pvt, algo, arch, transfer (the
original comparisons) and grid (Figure 5: download {32, 16, 12} x upload
{32, 8, 6, 4} uniform bits, plus TernGrad with / without clipping at
download 32 and 16). A stored run is reused only if its configuration
(spec, rounds, clients per round, seed) equals the requested one.
Also writes ``efficient_lm_fig5.png`` and
``efficient_lm_lstm_vs_transformer.png``.

Setup (SMALL-SCALE, CPU): Shakespeare (TFF, 715 real speaking-role clients)
as the stand-in for StackOverflow, SentencePiece 4,096 ids trained on the
training snippets, sequence length 30, client batch 16, at most 1,200
examples per client, 1 local epoch; the ``transformer_tiny`` preset (and
``lstm_tiny``), far smaller than Table 1; 10 clients per round and a few
hundred rounds instead of 800 x 10K. Evaluation: all test snippets.
Everything is seeded (``--seed``); keys per round and client come from
``fedlite_jax.training.runner.client_rng``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import platform
import subprocess
import sys
import time
from typing import Any

from absl import app
from absl import flags

import fedlite_jax  # noqa: F401  (FedJAX compatibility fixes first)
import fedjax
import jax
import numpy as np
import optax

from fedlite_jax import transforms
from fedlite_jax.algorithms import fedopt
from fedlite_jax.comm import CommLedger
from fedlite_jax.datasets import sentencepiece_vocab
from fedlite_jax.training import evaluation
from fedlite_jax.training import init_params
from fedlite_jax.training import pretrain
from fedlite_jax.training import runner
from fedlite_jax.models import lm

flags.DEFINE_string('data_dir', None, 'Shakespeare data directory.')
flags.DEFINE_string('out', str(pathlib.Path(__file__).parent / 'results'),
                    'Output directory.')
flags.DEFINE_integer('rounds', 100, 'Federated rounds per run.')
flags.DEFINE_integer('clients_per_round', 10, 'Cohort size.')
flags.DEFINE_integer('eval_every', 20, 'Evaluate every N rounds.')
flags.DEFINE_integer('seed', 0, 'Run seed.')
flags.DEFINE_integer('pretrain_steps', 1000, 'Centralized pretraining steps.')
flags.DEFINE_list('only', [], 'Run only these run names.')
flags.DEFINE_list('groups', [], 'Run only runs in these groups (quant, pvt, '
                  'algo, arch, transfer, grid); with --only: the union.')
flags.DEFINE_bool('rerun', False, 'Ignore existing run files.')
flags.DEFINE_bool('report_only', False, 'Only rebuild the report.')

FLAGS = flags.FLAGS

BATCH = 16
MAX_EXAMPLES = 1200
# Pretrained parameters (1.5 MB binaries) go to the git-ignored runs/.
PRETRAIN_DIR = (pathlib.Path(__file__).resolve().parent.parent / 'runs' /
                'pretrain')
SEQ_LEN = 30


@dataclasses.dataclass(frozen=True)
class RunSpec:
  """One experiment."""
  name: str
  label: str
  group: tuple[str, ...]
  model: str = 'transformer_tiny'
  algorithm: str = 'fedavg'        # fedavg (server Adam) | fedprox | mime_lite
  client_lr: float = 0.1
  client_clip: float = 16.0
  server_lr: float = 1e-2
  fedprox_mu: float = 0.0
  mime_lr: float = 0.1
  mime_eps: float = 1e-3
  download_bits: int = 32
  upload: str = 'none'             # none | uniform | terngrad | terngrad_noclip
  upload_bits: int = 32
  pvt: float = 1.0
  pretrained: bool = False


RUNS = [
    RunSpec('fedadam', 'FedAdam, 32/32 bits', ('quant', 'pvt', 'algo',
                                               'arch', 'transfer', 'grid')),
    RunSpec('upload8', 'upload 8-bit uniform', ('quant', 'grid'),
            upload='uniform', upload_bits=8),
    RunSpec('upload4', 'upload 4-bit uniform', ('quant', 'grid'),
            upload='uniform', upload_bits=4),
    RunSpec('terngrad', 'upload TernGrad (clip 2.5 std)', ('quant', 'grid'),
            upload='terngrad'),
    RunSpec('terngrad_noclip', 'upload TernGrad, no clipping',
            ('quant', 'grid'), upload='terngrad_noclip'),
    RunSpec('down16_up8', 'download 16 / upload 8 bits', ('quant', 'grid'),
            download_bits=16, upload='uniform', upload_bits=8),
    RunSpec('pvt40', 'PVT 40%', ('pvt',), pvt=0.4),
    RunSpec('pvt20', 'PVT 20%', ('pvt',), pvt=0.2),
    RunSpec('fedprox', 'FedProx mu=0.01 (server Adam)', ('algo',),
            algorithm='fedprox', fedprox_mu=0.01),
    RunSpec('mime_lite', 'MimeLite (Adagrad base)', ('algo',),
            algorithm='mime_lite'),
    RunSpec('lstm', 'CIFG-LSTM tiny, FedAdam', ('arch',), model='lstm_tiny'),
    RunSpec('pretrained', 'FedAdam from pretrained', ('transfer',),
            pretrained=True),
    RunSpec('efficient', 'pretrained + PVT 40% + upload 8-bit',
            ('transfer',), pretrained=True, pvt=0.4, upload='uniform',
            upload_bits=8),
    # Figure 5 grid: the remaining download x upload cells (uniform
    # quantizer; 32 download bits = no download quantization, 32 upload bits
    # = no upload quantization), and TernGrad at 16 download bits (the
    # paper's Figure 4 / 12 upload sweeps fix download at 16 bits).
    RunSpec('upload6', 'upload 6-bit uniform', ('grid',), upload='uniform',
            upload_bits=6),
    RunSpec('down16', 'download 16 / upload 32 bits', ('grid',),
            download_bits=16),
    RunSpec('down16_up6', 'download 16 / upload 6 bits', ('grid',),
            download_bits=16, upload='uniform', upload_bits=6),
    RunSpec('down16_up4', 'download 16 / upload 4 bits', ('grid',),
            download_bits=16, upload='uniform', upload_bits=4),
    RunSpec('down12', 'download 12 / upload 32 bits', ('grid',),
            download_bits=12),
    RunSpec('down12_up8', 'download 12 / upload 8 bits', ('grid',),
            download_bits=12, upload='uniform', upload_bits=8),
    RunSpec('down12_up6', 'download 12 / upload 6 bits', ('grid',),
            download_bits=12, upload='uniform', upload_bits=6),
    RunSpec('down12_up4', 'download 12 / upload 4 bits', ('grid',),
            download_bits=12, upload='uniform', upload_bits=4),
    RunSpec('down16_terngrad', 'download 16 / TernGrad (clip 2.5 std)',
            ('grid',), download_bits=16, upload='terngrad'),
    RunSpec('down16_terngrad_noclip', 'download 16 / TernGrad, no clipping',
            ('grid',), download_bits=16, upload='terngrad_noclip'),
    # Beyond the paper's Figure 5 cells: where download quantization starts
    # to hurt here (12 bits did not).
    RunSpec('down8_up8', 'download 8 / upload 8 bits', ('grid',),
            download_bits=8, upload='uniform', upload_bits=8),
    RunSpec('down6_up8', 'download 6 / upload 8 bits', ('grid',),
            download_bits=6, upload='uniform', upload_bits=8),
    RunSpec('down4_up8', 'download 4 / upload 8 bits', ('grid',),
            download_bits=4, upload='uniform', upload_bits=8),
]

# 8, 6, 4: extra cells at upload 8 only (beyond the paper's grid).
GRID_DOWNLOAD_BITS = (32, 16, 12, 8, 6, 4)
GRID_UPLOAD_BITS = (32, 8, 6, 4)
# Groups shown in the original overview figure / tables (the grid has its
# own section and figure).
OVERVIEW_GROUPS = ('quant', 'pvt', 'algo', 'arch', 'transfer')


def _config(spec: dict) -> dict:
  """The parts of a run that determine its result (not its name or label)."""
  return {k: v for k, v in spec.items() if k not in ('name', 'label',
                                                       'group')}


def _same_config(stored: dict, spec: RunSpec) -> bool:
  return (_config(stored['spec']) == _config(dataclasses.asdict(spec)) and
          stored['rounds'] == FLAGS.rounds and
          stored['clients_per_round'] == FLAGS.clients_per_round and
          stored['seed'] == FLAGS.seed)


def _compression(spec: RunSpec) -> fedopt.Compression:
  download = (None if spec.download_bits == 32 else
              transforms.uniform_quantization(spec.download_bits))
  upload = {
      'none': None,
      'uniform': (transforms.uniform_quantization(spec.upload_bits)
                  if spec.upload == 'uniform' else None),
      'terngrad': transforms.terngrad(),
      'terngrad_noclip': transforms.terngrad(clip_std=None),
  }[spec.upload]
  return fedopt.Compression(download=download, upload=upload,
                               pvt_fraction=spec.pvt)


def _algorithm(spec: RunSpec, model: fedjax.Model) -> Any:
  grad_fn = fedjax.model_grad(model)
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=BATCH, num_epochs=1)
  comp = _compression(spec)
  if spec.algorithm == 'mime_lite':
    base = optax.chain(optax.clip_by_global_norm(spec.client_clip),
                       optax.adagrad(spec.mime_lr, eps=spec.mime_eps))
    return fedopt.efficient_mime_lite(
        grad_fn, base, hp, grads_batch_size=BATCH, server_learning_rate=1.0,
        compression=comp, seed=FLAGS.seed, engine='loop')
  client = optax.chain(optax.clip_by_global_norm(spec.client_clip),
                       optax.sgd(spec.client_lr))
  server = optax.adam(spec.server_lr, b1=0.9, b2=0.999, eps=1e-8)
  return fedopt.efficient_federated_averaging(
      grad_fn, client, server, hp, fedprox_mu=spec.fedprox_mu,
      compression=comp, seed=FLAGS.seed, engine='loop')


def _pretrained_params(model_name: str, model: fedjax.Model,
                       tokenizer: sentencepiece_vocab.SubwordTokenizer,
                       out: pathlib.Path) -> tuple[Any, dict]:
  path = PRETRAIN_DIR / f'pretrained_{model_name}_seed{FLAGS.seed}.params'
  like = model.init(jax.random.PRNGKey(FLAGS.seed))
  if path.exists() and not FLAGS.rerun:
    return init_params.load_params(path, like), init_params.read_metadata(path)
  texts = pretrain.corpus_texts('python_help')
  data = pretrain.encode_chunks(tokenizer.piece_ids(texts), SEQ_LEN)
  params, info = pretrain.pretrain(
      model, like, data, steps=FLAGS.pretrain_steps, batch_size=BATCH,
      learning_rate=1e-3, clip_norm=16.0, seed=FLAGS.seed,
      log_every=FLAGS.pretrain_steps // 5)
  meta = {'corpus': 'python_help', 'model': model_name, **info}
  init_params.save_params(path, params, meta)
  return params, meta


def _run(spec: RunSpec, train, eval_batches, tokenizer, out) -> dict:
  model = lm.create_lm(spec.model, vocab_size=tokenizer.num_ids,
                       max_length=SEQ_LEN, oov_id=tokenizer.oov_id).model
  if spec.pretrained:
    params, pre = _pretrained_params(spec.model, model, tokenizer, out)
  else:
    params, pre = model.init(jax.random.PRNGKey(FLAGS.seed)), None
  alg = _algorithm(spec, model)
  state = alg.init(params)
  num_params = sum(x.size for x in jax.tree.leaves(params))
  ledger = CommLedger(num_params)
  sampler = fedjax.client_samplers.UniformGetClientSampler(
      train, FLAGS.clients_per_round, FLAGS.seed)
  rows = []
  wall0 = time.perf_counter()
  started = {'utc': time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime()),
             'proc_loadavg': _proc_loadavg()}
  m = evaluation.evaluate(model, params, eval_batches)
  rows.append({'round': 0, 'perplexity': m['perplexity'],
               'accuracy': m['accuracy'], 'upload_bytes': 0.0,
               'download_bytes': 0.0, 'seconds': 0.0})
  train_seconds = 0.0
  fractions = []
  for r in range(FLAGS.rounds):
    clients = [(cid, cds[:MAX_EXAMPLES], runner.client_rng(FLAGS.seed, r, cid))
               for cid, cds, _ in sampler.sample()]
    t0 = time.perf_counter()
    state, diag = alg.apply(state, clients)
    jax.block_until_ready(state.params)
    train_seconds += time.perf_counter() - t0
    ledger.record_round(r, diag)
    fractions += [d['pvt_trained_fraction'] for d in diag.values()]
    if (r + 1) % FLAGS.eval_every == 0 or r + 1 == FLAGS.rounds:
      m = evaluation.evaluate(model, state.params, eval_batches)
      s = ledger.summary()
      rows.append({'round': r + 1, 'perplexity': m['perplexity'],
                   'accuracy': m['accuracy'],
                   'upload_bytes': s['total_upload_bytes'],
                   'download_bytes': s['total_download_bytes'],
                   'seconds': train_seconds})
      print(f'{spec.name} round {r + 1}: ppl {m["perplexity"]:.2f} '
            f'acc {m["accuracy"]:.4f} ({train_seconds:.0f} s)', flush=True)
  s = ledger.summary()
  return {'spec': dataclasses.asdict(spec), 'rows': rows,
          'num_params': int(num_params),
          'rounds': FLAGS.rounds, 'clients_per_round': FLAGS.clients_per_round,
          'seed': FLAGS.seed, 'train_seconds': train_seconds,
          'seconds_per_round': train_seconds / FLAGS.rounds,
          'upload_bytes_per_client_round':
              s['total_upload_bytes'] / s['client_rounds'],
          'download_bytes_per_client_round':
              s['total_download_bytes'] / s['client_rounds'],
          'mean_pvt_fraction': float(np.mean(fractions)),
          'pretraining': pre, 'machine': _machine(),
          'started': started,
          'wall_seconds': time.perf_counter() - wall0,
          'command': ' '.join(['python'] + sys.argv),
          'code': _code_version()}


def _proc_loadavg() -> str:
  try:
    return pathlib.Path('/proc/loadavg').read_text().strip()
  except OSError:
    return ' '.join(f'{x:.2f}' for x in os.getloadavg())


def _code_version() -> dict:
  """Where fedlite_jax was imported from and the repository's HEAD."""
  repo = pathlib.Path(__file__).resolve().parent.parent
  info = {'fedlite_jax': str(pathlib.Path(fedlite_jax.__file__).parent)}
  try:
    info['git_head'] = subprocess.run(
        ['git', 'rev-parse', 'HEAD'], cwd=repo, capture_output=True,
        text=True, check=True).stdout.strip()
    info['fedlite_jax_dirty_files'] = subprocess.run(
        ['git', 'status', '--porcelain', '--', 'fedlite_jax'], cwd=repo,
        capture_output=True, text=True, check=True).stdout.split('\n')[:-1]
  except (OSError, subprocess.CalledProcessError):
    pass
  return info


def _machine() -> dict:
  return {'platform': platform.platform(), 'python':
              platform.python_version(), 'jax': jax.__version__,
          'backend': jax.default_backend(), 'cpus': os.cpu_count(),
          'load_average': os.getloadavg()}


def _fmt_bytes(b: float) -> str:
  for unit, scale in (('GB', 1e9), ('MB', 1e6), ('KB', 1e3)):
    if b >= scale:
      return f'{b / scale:.2f} {unit}'
  return f'{b:.0f} B'


def _report(results: dict[str, dict], out: pathlib.Path, info) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top

  all_results = results
  results = {n: r for n, r in all_results.items()
             if set(r['spec']['group']) & set(OVERVIEW_GROUPS)}
  groups = [('quant', 'Quantization (Fig. 3-5 shape)'),
            ('pvt', 'PVT (Fig. 2 / Table 4 shape)'),
            ('algo', 'FedAdam vs FedProx vs MimeLite (Fig. 7 shape)'),
            ('arch', 'Transformer vs CIFG-LSTM (Fig. 1 shape)'),
            ('transfer', 'Transfer learning + efficient combination '
             '(Fig. 6 / 8 shape)')]
  fig, axes = plt.subplots(2, 3, figsize=(16, 9))
  axes = axes.ravel()
  for ax, (g, title) in zip(axes, groups):
    for name, res in results.items():
      if g in res['spec']['group']:
        rows = res['rows']
        ax.plot([r['round'] for r in rows], [r['perplexity'] for r in rows],
                marker='.', label=res['spec']['label'])
    ax.set_title(title, fontsize=9)
    ax.set_xlabel('round')
    ax.set_ylabel('test perplexity')
    ax.set_yscale('log')
    ax.legend(fontsize=7)
  ax = axes[5]
  for name, res in results.items():
    if 'quant' in res['spec']['group'] or 'transfer' in res['spec']['group']:
      rows = res['rows'][1:]
      per_client = [r['upload_bytes'] / res['clients_per_round']
                    for r in rows]
      ax.plot(per_client, [r['perplexity'] for r in rows], marker='.',
              label=res['spec']['label'])
  ax.set_xscale('log')
  ax.set_yscale('log')
  ax.set_xlabel('total upload bytes per client slot')
  ax.set_ylabel('test perplexity')
  ax.set_title('Perplexity vs cumulative upload (Fig. 8 shape)', fontsize=9)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / 'efficient_lm.png', dpi=110)

  any_res = next(iter(results.values()))
  lines = [
      '# Efficient language-model FL, small scale (Ro et al. 2022 shapes)',
      '',
      '**Small-scale CPU runs, not a reproduction of the paper\'s numbers.** '
      'Real data: TFF Shakespeare (715 speaking-role clients) standing in '
      'for StackOverflow; SentencePiece unigram vocabulary of 4,096 ids '
      'trained on the training snippets (seed 0); sequence length 30; one '
      'example per snippet; client batch 16, <= 1,200 examples per client, '
      '1 local epoch, client SGD with global-norm clip 16; server Adam '
      '(beta 0.9/0.999, eps 1e-8). Models: `transformer_tiny` (D 64, MLP '
      '256, 2 blocks, 4 heads, 368,256 parameters) and `lstm_tiny` (CIFG, '
      'D 64, H 256, 381,696 parameters), not the 4-21M Table 1 models; '
      f'{any_res["clients_per_round"]} clients per round for '
      f'{any_res["rounds"]} rounds (paper: 800 x 10,000). Test perplexity '
      f'on all {info["test_examples"]} test snippets (exp of the mean '
      'token cross-entropy over non-PAD targets); accuracy excludes PAD, '
      'EOS and UNK. Seed '
      f'{any_res["seed"]}, one seed per setting (no error bars: differences '
      'of a few percent are within run-to-run noise).',
      '',
      'Command: `FEDLITE_DATA_DIR=<data dir> python '
      'experiments/lm_experiments.py` (defaults: '
      f'`--rounds={any_res["rounds"]} --clients_per_round='
      f'{any_res["clients_per_round"]} --seed={any_res["seed"]}`; '
      'client SGD lr 0.1 and server Adam lr 1e-2 chosen by a 5-point '
      'sweep at 40 rounds; ~25 min wall here for all runs).',
      '',
      f'Machine: {any_res["machine"]["platform"]}, '
      f'{any_res["machine"]["cpus"]} CPU cores shared with other jobs '
      f'(load average at start of the last run: '
      f'{any_res["machine"]["load_average"][0]:.1f}), JAX '
      f'{any_res["machine"]["jax"]} on {any_res["machine"]["backend"]}. '
      'Wall times are noisy (other processes); compare ratios only.',
      '',
      '| run | model | algorithm | down bits | upload | PVT (realized) | '
      'params | final ppl | best ppl | final acc | upload / client-round | '
      'download / client-round | s / round |',
      '|---|---|---|---|---|---|---|---|---|---|---|---|---|',
  ]
  for name, res in results.items():
    s = res['spec']
    rows = res['rows']
    up = {'none': '32-bit', 'uniform': f'{s["upload_bits"]}-bit uniform',
          'terngrad': 'TernGrad clip', 'terngrad_noclip': 'TernGrad no clip'
          }[s['upload']]
    algo = {'fedavg': 'FedAdam', 'fedprox': f'FedProx mu={s["fedprox_mu"]}',
            'mime_lite': 'MimeLite'}[s['algorithm']]
    if s['pretrained']:
      algo += ' (pretrained)'
    lines.append(
        f'| {name} | {s["model"]} | {algo} | {s["download_bits"]} | {up} | '
        f'{s["pvt"]:.0%} ({res["mean_pvt_fraction"]:.1%}) | '
        f'{res["num_params"]:,} | {rows[-1]["perplexity"]:.2f} | '
        f'{min(r["perplexity"] for r in rows):.2f} | '
        f'{rows[-1]["accuracy"]:.4f} | '
        f'{_fmt_bytes(res["upload_bytes_per_client_round"])} | '
        f'{_fmt_bytes(res["download_bytes_per_client_round"])} | '
        f'{res["seconds_per_round"]:.2f} |')
  lines += ['', '## Perplexity by round', '']
  names = list(results)
  rounds = [r['round'] for r in results[names[0]]['rows']]
  lines.append('| round | ' + ' | '.join(names) + ' |')
  lines.append('|---' * (len(names) + 1) + '|')
  for i, rnd in enumerate(rounds):
    cells = []
    for n in names:
      rows = results[n]['rows']
      cells.append(f'{rows[i]["perplexity"]:.1f}' if i < len(rows) else '')
    lines.append(f'| {rnd} | ' + ' | '.join(cells) + ' |')
  pre = [r['pretraining'] for r in results.values() if r['pretraining']]
  if pre:
    p = pre[0]
    lines += ['', f'Pretraining (phase 1): corpus `{p["corpus"]}` '
              '(CPython\'s `pydoc_data.topics` help pages, real English '
              f'prose, not Shakespeare), {p["examples"]:,} sequences of 30, '
              f'{p["steps"]} Adam steps (lr 1e-3, batch 16, clip 16) in '
              f'{p["seconds"]:.0f} s; final training loss '
              f'{p["final_train_loss"]:.1f} per sequence. Phase 2 starts '
              'federated FedAdam from those parameters.']
  lines += ['', '![curves](efficient_lm.png)', '']
  lines += _grid_section(all_results, out, plt)
  lines += _arch_section(all_results, out, plt)
  lines += ['## Reading the results', '', '__READING__', '']
  text = '\n'.join(lines)
  path = out / 'efficient_lm.md'
  old = path.read_text() if path.exists() else ''
  # Keep the hand-written interpretations across rebuilds.
  for placeholder, heading in _KEPT:
    text = text.replace(placeholder, _kept_block(old, heading) or
                        '(to be written after the runs)')
  path.write_text(text + '\n')


# (placeholder, heading) of the hand-written blocks kept across rebuilds.
_KEPT = (('__GRID_READING__', '### Comparison with the paper (Figure 5)'),
         ('__ARCH_READING__', '### Reading (Transformer vs LSTM)'),
         ('__READING__', '## Reading the results'))


def _kept_block(old: str, heading: str) -> str:
  marker = heading + '\n\n'
  if marker not in old:
    return ''
  block = old.split(marker, 1)[1]
  for stop in ('\n## ', '\n### '):
    block = block.split(stop, 1)[0]
  return block.strip()


def _upload_name(s: dict) -> str:
  if s['upload'] == 'none':
    return '32'
  if s['upload'] == 'uniform':
    return str(s['upload_bits'])
  return {'terngrad': 'TernGrad clip', 'terngrad_noclip':
          'TernGrad no clip'}[s['upload']]


def _grid_cells(results: dict[str, dict]) -> dict[tuple[int, str], dict]:
  """(download bits, upload name) -> result, for the grid's runs."""
  cells = {}
  for res in results.values():
    s = res['spec']
    if 'grid' in s['group']:
      cells[(s['download_bits'], _upload_name(s))] = res
  return cells


def _total_bytes(res: dict) -> float:
  return (res['upload_bytes_per_client_round'] +
          res['download_bytes_per_client_round'])


def _grid_section(results: dict[str, dict], out: pathlib.Path,
                  plt) -> list[str]:
  """Figure 5: final perplexity vs bytes per client-round; the grid table."""
  import matplotlib.ticker  # pylint: disable=g-import-not-at-top
  cells = _grid_cells(results)
  if not cells:
    return []
  uploads = [str(b) for b in GRID_UPLOAD_BITS] + ['TernGrad clip',
                                                   'TernGrad no clip']
  base = cells.get((32, '32'))
  base_ppl = base['rows'][-1]['perplexity'] if base else None
  colors = {32: 'tab:blue', 16: 'tab:orange', 12: 'tab:green',
            8: 'tab:red', 6: 'tab:purple', 4: 'tab:brown'}

  fig, axes = plt.subplots(1, 3, figsize=(18, 7))
  ax = axes[0]
  for d in GRID_DOWNLOAD_BITS:
    pts = [(_total_bytes(cells[(d, u)]) / 1e3,
            cells[(d, u)]['rows'][-1]['perplexity'], u)
           for u in uploads[:len(GRID_UPLOAD_BITS)] if (d, u) in cells]
    if pts:
      ax.plot([p[0] for p in pts], [p[1] for p in pts], marker='o',
              color=colors[d], label=f'download {d} bits, uniform upload')
    for u, mk in (('TernGrad clip', 'X'), ('TernGrad no clip', 'P')):
      if (d, u) in cells:
        res = cells[(d, u)]
        pts.append((_total_bytes(res) / 1e3, res['rows'][-1]['perplexity'],
                    'T' if u == 'TernGrad clip' else 'T-nc'))
        ax.plot([pts[-1][0]], [pts[-1][1]], marker=mk, markersize=9,
                linestyle='none', color=colors[d],
                label=f'download {d}, {u}')
    for x, y, u in pts:
      ax.annotate(f'{d}/{u}', (x, y), textcoords='offset points',
                  xytext=(4, 3), fontsize=7)
  if base_ppl is not None:
    ax.axhline(base_ppl, linestyle='--', color='gray', linewidth=1,
               label='32/32 baseline')
  ax.set_xscale('log')
  ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
  ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
  ax.set_xticks([500, 700, 1000, 1500, 2000, 3000])
  ax.set_xlabel('bytes per client-round, upload + download (KB)')
  ax.set_ylabel(f'test perplexity after {base["rounds"] if base else "?"} '
                'rounds')
  ax.set_title('Figure 5 shape: perplexity vs communication per round '
               '(labels: download/upload bits; T = TernGrad, T-nc = no '
               'clip)', fontsize=8)
  ax.legend(fontsize=7, loc='upper center', bbox_to_anchor=(0.5, -0.14),
            ncol=2)
  for ax, fixed, title in (
      (axes[1], 'upload', 'Figure 3 shape: download bits, upload 8 bits'),
      (axes[2], 'download', 'Figure 4 shape: upload bits, download 16 bits')):
    if fixed == 'upload':
      series = [((d, '8'), f'download {d}') for d in GRID_DOWNLOAD_BITS]
    else:
      series = [((16, u), f'upload {u}') for u in uploads]
    for key, label in series:
      if key in cells:
        rows = cells[key]['rows'][1:]
        ax.plot([r['round'] for r in rows], [r['perplexity'] for r in rows],
                marker='.', label=label)
    if base is not None:
      rows = base['rows'][1:]
      ax.plot([r['round'] for r in rows], [r['perplexity'] for r in rows],
              linestyle='--', color='gray', label='32/32 baseline')
    ax.set_yscale('log')
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel('round')
    ax.set_ylabel('test perplexity (log scale)')
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out / 'efficient_lm_fig5.png', dpi=110)
  plt.close(fig)

  any_res = next(iter(cells.values()))
  new = [r for r in cells.values() if 'started' in r]
  lines = [
      '## Figure 5 grid', '',
      '`transformer_tiny`, FedAdam (setup as above), '
      f'{any_res["rounds"]} rounds x {any_res["clients_per_round"]} '
      f'clients, seed {any_res["seed"]} for every cell (including the 32/32 '
      'baseline). Download = the server model broadcast each round, upload '
      '= each client\'s model delta; both with the stochastic uniform '
      'quantizer (per leaf, 2^bits levels between the leaf\'s min and max, '
      'unbiased rounding; 32 bits = not quantized). TernGrad: log2(3) bits '
      'per value, with (2.5 std) and without clipping. Bytes are what the '
      'CommLedger counted per client-round (values x bits / 8 plus the '
      'per-leaf floats), one seed per cell (differences of a few percent '
      'are within run-to-run noise).', '',
      'Final test perplexity after '
      f'{any_res["rounds"]} rounds (rows: download bits; columns: upload '
      'bits; "-" = not run):', '',
      '| download \\ upload | ' + ' | '.join(uploads) + ' |',
      '|---' * (len(uploads) + 1) + '|']
  for d in GRID_DOWNLOAD_BITS:
    lines.append(f'| {d} | ' + ' | '.join(
        f'{cells[(d, u)]["rows"][-1]["perplexity"]:.1f}' if (d, u) in cells
        else '-' for u in uploads) + ' |')
  lines += ['', 'Bytes per client-round, upload + download:', '',
            '| download \\ upload | ' + ' | '.join(uploads) + ' |',
            '|---' * (len(uploads) + 1) + '|']
  for d in GRID_DOWNLOAD_BITS:
    lines.append(f'| {d} | ' + ' | '.join(
        _fmt_bytes(_total_bytes(cells[(d, u)])) if (d, u) in cells
        else '-' for u in uploads) + ' |')
  lines += ['', 'Per run ("reused": the stored run of the sections above, '
            'same configuration; rerunning the 32/32 baseline at the grid\'s '
            'code version reproduced its stored perplexities bit for bit):',
            '',
            '| run | down | up | upload / client-round | download / '
            'client-round | total | final ppl | vs 32/32 | final acc | '
            's / round | wall s | started (UTC) | /proc/loadavg at start |',
            '|---' * 13 + '|']
  for d in GRID_DOWNLOAD_BITS:
    for u in uploads:
      if (d, u) not in cells:
        continue
      res = cells[(d, u)]
      ppl = res['rows'][-1]['perplexity']
      rel = f'{ppl / base_ppl - 1:+.1%}' if base_ppl else ''
      st = res.get('started')
      lines.append(
          f'| {res["spec"]["name"]} | {d} | {u} | '
          f'{_fmt_bytes(res["upload_bytes_per_client_round"])} | '
          f'{_fmt_bytes(res["download_bytes_per_client_round"])} | '
          f'{_fmt_bytes(_total_bytes(res))} | {ppl:.2f} | {rel} | '
          f'{res["rows"][-1]["accuracy"]:.4f} | '
          f'{res["seconds_per_round"]:.2f} | ' +
          (f'{res["wall_seconds"]:.0f} | {st["utc"]} | `{st["proc_loadavg"]}`'
           if st else 'reused | reused | (not recorded)') + ' |')
  if new:
    code = new[0].get('code', {})
    m = new[0]['machine']
    lines += [
        '',
        f'New runs in this table: {len(new)}, command(s) ' + ', '.join(
            f'`FEDLITE_DATA_DIR=<data dir> {c}`' for c in
            dict.fromkeys(r['command'] for r in new)) +
        f' (seed {new[0]["seed"]}, the default; existing run files with the '
        'same configuration are reused), '
        f'{sum(r["wall_seconds"] for r in new):.0f}'
        ' s wall in all (training + 6 evaluations each, s / round counts '
        f'training only). Machine: {m["platform"]}, {m["cpus"]} CPU cores '
        f'shared with other jobs, JAX {m["jax"]} on {m["backend"]}; '
        'load at the start of each run in the table (1/5/15-min averages, '
        'running/total tasks, last pid). fedlite_jax imported from '
        f'`{code.get("fedlite_jax", "?")}` at repository HEAD '
        f'`{code.get("git_head", "?")[:12]}`.']
  lines += ['', '![Figure 5 grid](efficient_lm_fig5.png)', '',
            '### Comparison with the paper (Figure 5)', '',
            '__GRID_READING__', '']
  return lines


def _arch_section(results: dict[str, dict], out: pathlib.Path,
                  plt) -> list[str]:
  """Perplexity vs rounds, tiny Transformer vs tiny CIFG-LSTM."""
  pair = [(n, r) for n, r in results.items()
          if 'arch' in r['spec']['group']]
  if len(pair) < 2:
    return []
  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  for n, res in pair:
    rows = res['rows']
    label = f'{res["spec"]["model"]} ({res["num_params"]:,} params)'
    axes[0].plot([r['round'] for r in rows[1:]],
                 [r['perplexity'] for r in rows[1:]], marker='o', label=label)
    axes[1].plot([r['round'] for r in rows], [r['accuracy'] for r in rows],
                 marker='o', label=label)
  axes[0].set_yscale('log')
  axes[0].set_ylabel('test perplexity (round 0 left out)')
  axes[1].set_ylabel('test next-token accuracy')
  for ax in axes:
    ax.set_xlabel('round')
    ax.legend(fontsize=8)
  fig.suptitle('Tiny Transformer vs tiny CIFG-LSTM, FedAdam, same rounds, '
               'seed and learning rates (Figure 1 shape)', fontsize=10)
  fig.tight_layout()
  fig.savefig(out / 'efficient_lm_lstm_vs_transformer.png', dpi=110)
  plt.close(fig)
  first = pair[0][1]
  lines = ['## Transformer vs CIFG-LSTM over rounds', '',
           f'Runs `{pair[0][0]}` and `{pair[1][0]}` from the table above '
           f'({first["rounds"]} rounds x {first["clients_per_round"]} '
           f'clients, seed {first["seed"]}, identical client / server '
           'optimizers and sampling). Test perplexity (accuracy):', '',
           '| round | ' + ' | '.join(
               f'{r["spec"]["model"]} ({r["num_params"]:,})'
               for _, r in pair) + ' |',
           '|---' * (len(pair) + 1) + '|']
  for i, row in enumerate(first['rows']):
    lines.append(f'| {row["round"]} | ' + ' | '.join(
        f'{r["rows"][i]["perplexity"]:.1f} ({r["rows"][i]["accuracy"]:.4f})'
        for _, r in pair) + ' |')
  lines += ['', '![Transformer vs LSTM](efficient_lm_lstm_vs_transformer.png)',
            '', '### Reading (Transformer vs LSTM)', '', '__ARCH_READING__',
            '']
  return lines


def main(argv):
  del argv
  out = pathlib.Path(FLAGS.out)
  runs_dir = out / 'efficient_lm_runs'
  runs_dir.mkdir(parents=True, exist_ok=True)
  train, test, info = sentencepiece_vocab.load_shakespeare_sp(
      FLAGS.data_dir, sequence_length=SEQ_LEN)
  tokenizer = sentencepiece_vocab.load_tokenizer(info.cached_files[-1])
  eval_batches = evaluation.eval_batches(test, 512, 0, FLAGS.seed)
  test_examples = int(sum(len(cds) for _, cds in test.clients()))
  results = {}
  for spec in RUNS:
    path = runs_dir / f'{spec.name}.json'
    selected = ((not FLAGS.only and not FLAGS.groups) or
                spec.name in FLAGS.only or
                bool(set(FLAGS.groups) & set(spec.group)))
    if path.exists():
      stored = json.loads(path.read_text())
      same = _same_config(stored, spec)
      if same and (FLAGS.report_only or not FLAGS.rerun or not selected):
        # Reuse; name, label and groups come from the current RunSpec.
        stored['spec'].update(name=spec.name, label=spec.label,
                              group=list(spec.group))
        results[spec.name] = stored
        continue
      if not same:
        print(f'{spec.name}: stored run has a different configuration '
              f'(rounds {stored["rounds"]}, seed {stored["seed"]}); '
              + ('rerunning' if selected and not FLAGS.report_only
                 else 'left out of the report'), flush=True)
    if FLAGS.report_only or not selected:
      continue
    res = _run(spec, train, eval_batches, tokenizer, out)
    path.write_text(json.dumps(res, indent=1))
    results[spec.name] = res
  if results:
    _report(results, out, {'test_examples': test_examples})


if __name__ == '__main__':
  app.run(main)
