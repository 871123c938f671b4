#!/usr/bin/env python3
"""Distributed DP under secure aggregation on FEMNIST-105: accuracy vs bits.

  FEDLITE_DATA_DIR=/path/to/data python experiments/ddp_femnist.py

Test accuracy against the bits B per coordinate of the secure sum
(``--dp_mechanism=ddgauss|skellam --dp_bits=B``, ``--bits``) at one epsilon
(``--epsilon``, delta = 1e-6 after ``--rounds`` rounds, z calibrated by
``--dp_target_epsilon``), beside central DP-FedAvg
(``--dp_mechanism=gaussian``: same clip, epsilon, population and clients per
round, no noise cohort) and no DP, for the full model (FedAvg, one local
step; the secure sum's vector is the CNN's 1,206,590 parameters padded to
2^21) and IGC static (d = 4,096, padded_dim 4,096) at ``--igc_bits``
(default 16). Under a distributed mechanism the noise is the shares of the
round's own ``--clients_per_round`` clients (no ``--dp_noise_cohort_size``),
so the defaults give each round 50 clients, and the accounting a population
of 3,400 (FEMNIST's writers; q = 50 / 3,400; the simulation draws the 50
from FEMNIST-105's 105 training writers). Each client's update is clipped to
``--clip`` = 0.1 (one-step updates have norm ~0.75: every one is clipped, so
the server moves by ``--server_lr`` x 0.1 per round and the noise is
relative to that); training: batch 20, client SGD 0.3, as
``experiments/dp_femnist.py``; server SGD ``--server_lr`` = 3 (a pilot, seed
0, 100 rounds: central DP 59.6% at 3 against 54.5% at 1; no DP 70.6% and
71.1%); the no-DP rows train at ``--nodp_server_lr`` = 1, the setting's
(their updates are unclipped, ~7x the clip: IGC static at 3 diverged,
loss 5,106 at round 12, seed 0). Same seed = same
initialisation, cohorts, subspace and noise keys across rows.

A cell whose epsilon no noise reaches at its B (the runner's
``--dp_target_epsilon: ... unreachable``: rounding to B bits costs more
sensitivity than noise can cover) is listed as unreachable, not trained.
Rows run cheapest first within each seed (IGC before the full model), so a
failing configuration stops the study early; a finished run is reused when
the study is restarted (``provenance.run_or_reuse``).

Writes ``ddp_femnist.json`` (rows under ``results`` with ``seeds``;
per-seed accuracy = mean of the last 3 evaluations; upload bits per client
per round from summary.json; the privacy section's epsilon, z, gamma,
padded dim; the largest ``privacy/wrapped_fraction`` of metrics.jsonl;
``unreachable`` cells; paired differences of every distributed row against
central DP; a ``check`` re-running IGC with the first mechanism at B = 16
for ``--check_rounds`` rounds), ``ddp_femnist.md`` and ``ddp_femnist.png``
(accuracy vs B per mechanism, bands for central DP and no DP).
``--models`` / ``--mechanisms`` / ``--bits`` / ``--igc_bits`` pick a subset
(tests); ``--report_only`` rewrites the .md and .png from the .json.
"""

from __future__ import annotations

import json
import os
import pathlib

from absl import app
from absl import flags

import femnist_setting
import provenance
import stats

from fedlite_jax.training import outputs

NAME = 'ddp_femnist'
provenance.define_study_flags(NAME, range(3))
flags.DEFINE_integer('rounds', 100, 'Rounds per run.', lower_bound=1)
flags.DEFINE_integer('check_rounds', 3, 'Rounds of the check run.',
                     lower_bound=1)
flags.DEFINE_integer('clients_per_round', 50, 'Clients per round: the '
                     'secure sum\'s noise shares (distributed DP) and the '
                     'central mechanism\'s cohort.', lower_bound=1)
flags.DEFINE_float('epsilon', 8.0, 'Target epsilon of every DP row, at '
                   'delta = 1e-6 after --rounds rounds.', lower_bound=0.0)
flags.DEFINE_float('clip', 0.1, 'L2 clip norm C of each client\'s update.',
                   lower_bound=0.0)
flags.DEFINE_integer('population', 3400, 'Population of the accounting '
                     '(q = clients_per_round / population); 3,400: '
                     'FEMNIST\'s writers.', lower_bound=1)
flags.DEFINE_float('server_lr', 3.0, 'Server SGD learning rate (3: the '
                   'clipped mean has norm <= 0.1; central DP reached 59.6% '
                   'after 100 rounds at 3 against 54.5% at 1, no DP 70.6% '
                   'and 71.1%; seed 0).', lower_bound=0.0)
flags.DEFINE_float('nodp_server_lr', 1.0, 'Server SGD learning rate of '
                   'the no-DP rows (unclipped updates).', lower_bound=0.0)
flags.DEFINE_list('models', ['igc', 'full'], 'Models (row groups): igc '
                  '(IGC static, d = 4,096), full (FedAvg, the full CNN).')
flags.DEFINE_list('mechanisms', ['ddgauss', 'skellam'],
                  'Distributed mechanisms (rows).')
flags.DEFINE_list('bits', ['10', '12', '14', '16', '18', '20'],
                  'Bits B of the full model\'s distributed rows.')
flags.DEFINE_list('igc_bits', ['16'], 'Bits B of IGC\'s distributed rows.')
flags.DEFINE_string('data_dir', '', 'FEMNIST data folder (sets '
                    '$FEDLITE_DATA_DIR for the runs); empty: the '
                    'environment\'s.')
FLAGS = flags.FLAGS

DELTA = 1e-6
MECHANISMS = ('ddgauss', 'skellam')
#: Reference rows of each model: no DP and central DP-FedAvg.
REFERENCES = ('nodp', 'gaussian')
#: model: (label, run_experiment flags): experiments/femnist_setting.py's.
MODELS = {
    'igc': (femnist_setting.IGC_LABEL, femnist_setting.IGC),
    'full': ('full model', femnist_setting.FULL),
}
#: The report's order (the full model's B grid first).
REPORT_ORDER = ('full', 'igc')
MECH_LABEL = {'nodp': 'no DP', 'gaussian': 'central DP',
              'ddgauss': 'distributed discrete Gaussian',
              'skellam': 'distributed Skellam'}
#: summary.json privacy keys kept per run.
_PRIVACY_KEYS = ('mechanism', 'epsilon', 'noise_multiplier', 'bits', 'gamma',
                 'padded_dim', 'upload_bits_per_client', 'central_noise_std',
                 'local_noise_std', 'sampling_probability')


def _name(model: str, mech: str, bits: int | None = None) -> str:
  return f'{model}_{mech}' if bits is None else f'{model}_{mech}_b{bits}'


def _parse(name: str) -> tuple[str, str, int | None]:
  """``(model, mechanism, bits or None)`` of a row name."""
  model, mech, *b = name.split('_')
  return model, mech, int(b[0][1:]) if b else None


def _flags(name: str, seed: int, rounds: int, out: str) -> list[str]:
  """The run_experiment.py flags of row ``name``."""
  model, mech, bits = _parse(name)
  lr = FLAGS.nodp_server_lr if mech == 'nodp' else FLAGS.server_lr
  dp = [] if mech == 'nodp' else [
      f'--dp_clip={FLAGS.clip:g}', f'--dp_target_epsilon={FLAGS.epsilon:g}',
      f'--dp_delta={DELTA:g}', f'--dp_population={FLAGS.population}']
  if bits is not None:
    dp += [f'--dp_mechanism={mech}', f'--dp_bits={bits}']
  elif mech == 'gaussian':
    dp += ['--dp_mechanism=gaussian']
  return [*MODELS[model][1], *femnist_setting.TRAIN,
          f'--clients_per_round={FLAGS.clients_per_round}',
          f'--server_lr={lr:g}', *dp, f'--num_rounds={rounds}',
          f'--seed={seed}', f'--eval_every={max(1, rounds // 4)}',
          '--checkpoint_every=0', f'--output_dir={out}', '--noprogress']


def _unreachable(error: RuntimeError) -> str | None:
  """The runner's one-line refusal of an unreachable target epsilon, or
  None for any other failure."""
  return next((line.split('error: ', 1)[-1] for line in str(error).splitlines()
               if '--dp_target_epsilon:' in line and 'unreachable' in line),
              None)


def _train(name: str, seed: int, unreachable: dict) -> dict | None:
  """One run of row ``name`` (None: its epsilon is unreachable, recorded
  in ``unreachable``; the same for every seed, so tried once)."""
  if name in unreachable:
    return None
  out = f'{FLAGS.runs_dir}/{name}_seed{seed}'
  flags_ = _flags(name, seed, FLAGS.rounds, out)
  try:
    rec = provenance.seeded_run(flags_, FLAGS.rounds, seed)
  except RuntimeError as e:
    why = _unreachable(e)
    if why is None:
      raise
    print(f'{name}: unreachable: {why}', flush=True)
    model, mech, bits = _parse(name)
    unreachable[name] = {
        'run': name, 'model': model, 'mechanism': mech, 'bits': bits,
        'reason': why, 'command': provenance.command_line(
            [provenance.RUNNER, *flags_])}
    return None
  run_dir = provenance.REPO / out
  p = json.loads((run_dir / 'summary.json').read_text()).get('privacy')
  rec['privacy'] = p and {k: p[k] for k in _PRIVACY_KEYS if k in p}
  wrapped = [r['privacy/wrapped_fraction'] for r in
             outputs.read_metrics(run_dir / 'metrics.jsonl')
             if 'privacy/wrapped_fraction' in r]
  rec['wrapped_fraction_max'] = max(wrapped) if wrapped else None
  return rec


def _row(name: str, runs: dict, seeds: list[int]) -> dict:
  """A results row over ``seeds`` of ``runs`` (``{seed: run}``)."""
  model, mech, bits = _parse(name)
  first = runs[seeds[0]]
  comm, p = first['communication'], first['privacy'] or {}
  wrapped = [runs[s]['wrapped_fraction_max'] for s in seeds
             if runs[s]['wrapped_fraction_max'] is not None]
  return {
      'run': name, 'label': f'{MODELS[model][0]}, {MECH_LABEL[mech]}'
                            + ('' if bits is None else f', B = {bits}'),
      'model': model, 'mechanism': mech, 'bits': bits, 'seeds': seeds,
      'noise_multiplier': p.get('noise_multiplier'),
      'epsilon': max(((runs[s]['privacy'] or {}).get('epsilon', float('inf'))
                      for s in seeds), default=None) if p else None,
      'gamma': p.get('gamma'), 'padded_dim': p.get('padded_dim'),
      'privacy_upload_bits_per_client': p.get('upload_bits_per_client'),
      'wrapped_fraction_max': max(wrapped) if wrapped else None,
      'accuracy': stats.summarize([runs[s]['accuracy'] for s in seeds]),
      # Every client uploads the same size: bits per client and round.
      'upload_bits_per_client': 8 * comm['total_upload_bytes'] /
                                comm['client_rounds'],
      'download_bits_per_client': 8 * comm['total_download_bytes'] /
                                  comm['client_rounds'],
      'runs': [runs[s] for s in seeds]}


def _comparisons(data: dict) -> list[dict]:
  """Each distributed row against its model's central DP; central DP
  against no DP."""
  acc = {r['run']: {x['seed']: x['accuracy'] for x in r['runs']}
         for r in data['results']}
  pairs = []
  for r in data['results']:
    central = _name(r['model'], 'gaussian')
    if r['bits'] is not None:
      pairs.append((f'{MODELS[r["model"]][0]}: {r["mechanism"]} B = '
                    f'{r["bits"]} - central DP', r['run'], central))
    elif r['mechanism'] == 'gaussian':
      pairs.append((f'{MODELS[r["model"]][0]}: central DP - no DP', r['run'],
                    _name(r['model'], 'nodp')))
  return [{'label': label, 'a': a, 'b': b, **stats.paired(acc[a], acc[b])}
          for label, a, b in pairs if a in acc and b in acc]


def _claim_lines(data: dict) -> list[str]:
  """Per model and mechanism: what the paired differences against central
  DP support at B <= 16 (the papers' claim: matching central DP at 16 bits
  or fewer)."""
  comps = {c['a']: c for c in data['comparisons']
           if c['b'].endswith('_gaussian')}
  out = []
  for model in REPORT_ORDER:
    for mech in MECHANISMS:
      cells = sorted((r['bits'], comps[r['run']]) for r in data['results']
                     if r['model'] == model and r['mechanism'] == mech
                     and r['run'] in comps and r['bits'] <= 16)
      lost = sorted(u['bits'] for u in data['unreachable']
                    if u['model'] == model and u['mechanism'] == mech)
      if not cells and not lost:
        continue
      lower, higher, split = [], [], []
      for b, c in cells:
        text = f'B = {b} ({stats.fmt_paired(c, 1, 100)})'
        if c['n'] < 3 or c['agree'] < c['n']:
          split.append(text)
        else:
          (lower if c['mean'] < 0 else higher).append(text)
      parts = [f'below central DP in every seed at {"; ".join(lower)}'
               ] if lower else []
      parts += [f'above central DP in every seed at {"; ".join(higher)}'
                ] if higher else []
      parts += [f'no difference supported (fewer than 3 seeds or signs '
                f'split) at {"; ".join(split)}'] if split else []
      parts += [f'epsilon {data["meta"]["epsilon"]:g} unreachable at B = '
                f'{", ".join(map(str, lost))}'] if lost else []
      out.append(f'- {MODELS[model][0]}, {mech}: ' + '; '.join(parts) + '.')
  return out


def _fmt(x, spec: str) -> str:
  return '-' if x is None else format(x, spec)


def _not_run(data: dict) -> list[str]:
  """A line naming the models this file has no rows of."""
  ran = {r['model'] for r in data['results']} | {
      u['model'] for u in data['unreachable']}
  missing = [m for m in REPORT_ORDER if m not in ran]
  return ['', 'Not run for this file: ' + ', '.join(
      f'{MODELS[m][0]} (`--models={m}`)' for m in missing) +
          ' (docs/notes/privacy.md gives its cost).'] if missing else []


def _report(data: dict, out: pathlib.Path) -> None:
  data['comparisons'] = _comparisons(data)
  m = data['meta']
  check = data.get('check', {})
  lines = [
      '# Distributed DP under secure aggregation on FEMNIST-105: accuracy '
      'vs bits, over seeds', '',
      provenance.markdown_header(data['provenance']),
      f'{m["rounds"]} one-step rounds, {m["clients_per_round"]} clients per '
      f'round (batch 20, client SGD 0.3, server SGD {m["server_lr"]:g}; '
      f'no DP: {m["nodp_server_lr"]:g}, its updates being unclipped). '
      f'Every DP row: each client\'s update clipped to C = {m["clip"]:g} '
      '(under IGC: its d coordinates), uniform weights, z calibrated to '
      f'epsilon = {m["epsilon"]:g} at delta = {m["delta"]:g} after the '
      'rounds, Poisson sampling at q = clients per round / population = '
      f'{m["clients_per_round"]} / {m["population"]:,}. Central DP '
      '(`--dp_mechanism=gaussian`): a trusted server adds Gaussian noise of '
      'std z C to the sum (no noise cohort: the noise is that of the '
      'round\'s clients). Distributed (`--dp_mechanism=ddgauss|skellam '
      '--dp_bits=B`): each client rotates, scales by 1/gamma, rounds and '
      'noises its clipped update with its share of discrete noise and '
      'uploads B-bit integers; the server sees only their sum mod 2^B (the '
      'papers\' k = 4 (ddgauss) / 3 (skellam) standard deviations in 2^B, '
      'rounding beta = exp(-0.5)); its epsilon is the mechanism\'s RDP bound '
      'with the rounded sensitivities, amplified by subsampling as Zhu & '
      'Wang 2019 bound it (central DP: dp_accounting\'s RDP of the '
      'subsampled Gaussian), so the z column shows how much noise each row '
      'needs for the same epsilon. FedAvg weights clients by examples '
      'without DP and uniformly with it; IGC uniformly. Upload: bits per '
      'client per round '
      '(summary.json\'s communication; B x padded dim for the distributed '
      'rows, 32-bit floats otherwise). Accuracy: test accuracy on all test '
      'examples, mean of the last 3 evaluations of each run, then mean ± '
      'std over seeds. Wrapped: the largest fraction of the secure sum\'s '
      'coordinates that wrapped mod 2^B in any round of any seed.', '',
      '| model | mechanism | B | z | epsilon | gamma | wrapped | accuracy '
      '(%) | upload bits / client / round |',
      '|---|---|---|---|---|---|---|---|---|']
  rows = [(r, None) for r in data['results']] + [
      (None, u) for u in data['unreachable']]
  rank = (*REFERENCES, *MECHANISMS)
  order = lambda ru: (REPORT_ORDER.index((ru[0] or ru[1])['model']),
                      (ru[0] or ru[1])['bits'] or 0,
                      rank.index((ru[0] or ru[1])['mechanism']))
  for r, u in sorted(rows, key=order):
    if u is not None:
      lines.append(f'| {MODELS[u["model"]][0]} | '
                   f'{MECH_LABEL[u["mechanism"]]} | {u["bits"]} | - | '
                   'unreachable | - | - | - | - |')
      continue
    lines.append(
        f'| {MODELS[r["model"]][0]} | {MECH_LABEL[r["mechanism"]]} | '
        f'{_fmt(r["bits"], "d")} | {_fmt(r["noise_multiplier"], ".3f")} | '
        f'{_fmt(r["epsilon"], ".3f")} | {_fmt(r["gamma"], ".3g")} | '
        f'{_fmt(r["wrapped_fraction_max"], ".2g")} | '
        f'{stats.fmt(r["accuracy"], 1, 100)} | '
        f'{r["upload_bits_per_client"]:,.0f} |')
  if data['unreachable']:
    lines += ['', 'Unreachable: the runner refuses the cell because no noise '
              f'reaches epsilon {m["epsilon"]:g} at its B (it states: '
              f'"{data["unreachable"][0]["reason"]}").']
  lines += _not_run(data)
  lines += stats.comparison_lines(data['comparisons'])
  lines += ['',
            'Against central DP at B <= 16 (the papers\' claim: distributed '
            'DP matches central DP with 16 bits or fewer). A split sign '
            'means the seeds support no difference, not that the two are '
            'equal; a sign in every seed is a difference in this setup:', '',
            *(_claim_lines(data) or ['- no distributed row at B <= 16.']),
            '', f'![accuracy vs bits]({NAME}.png)', '',
            'Figure: test accuracy vs B, mean ± std over seeds, a line per '
            'distributed mechanism; bands: central DP and no DP (mean ± std); '
            'unreachable cells have no point.', '']
  if check:
    lines += [f'Check ({check["label"]}; tests/test_experiment_results.py '
              're-runs it at HEAD and compares its curve within the '
              'tolerance below):', '', f'    {check["command"]}', '']
  (out / f'{NAME}.md').write_text(provenance.results_md(lines, check))
  _plot(data, out / f'{NAME}.png')


def _plot(data: dict, path: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  models = [m for m in REPORT_ORDER
            if any(r['model'] == m for r in data['results'])]
  fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.8),
                           squeeze=False)
  for ax, model in zip(axes[0], models):
    rows = [r for r in data['results'] if r['model'] == model]
    allbits = sorted({r['bits'] for r in rows if r['bits'] is not None} |
                     {u['bits'] for u in data['unreachable']
                      if u['model'] == model})
    for mech, color in (('nodp', 'tab:gray'), ('gaussian', 'tab:green')):
      ref = next((r for r in rows if r['mechanism'] == mech), None)
      if ref is not None:
        a = ref['accuracy']
        ax.axhspan(100 * (a['mean'] - a['std']), 100 * (a['mean'] + a['std']),
                   color=color, alpha=0.2)
        ax.axhline(100 * a['mean'], color=color, ls='--',
                   label=MECH_LABEL[mech])
    for mech in MECHANISMS:
      got = sorted((r for r in rows if r['mechanism'] == mech),
                   key=lambda r: r['bits'])
      if got:
        ax.errorbar([r['bits'] for r in got],
                    [100 * r['accuracy']['mean'] for r in got],
                    [100 * r['accuracy']['std'] for r in got], marker='o',
                    capsize=3, label=MECH_LABEL[mech])
    if allbits:
      ax.set_xticks(allbits)
    ax.set(xlabel='bits B per coordinate of the secure sum',
           ylabel='test accuracy (%)', title=MODELS[model][0])
    ax.legend(fontsize=8)
  m = data['meta']
  fig.suptitle(f'FEMNIST-105, epsilon {m["epsilon"]:g} (delta '
               f'{m["delta"]:g}), {m["clients_per_round"]} clients / round')
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _names() -> list[str]:
  """The study's rows, cheapest first: per model (IGC first), no DP,
  central DP, then each mechanism by B."""
  bad = [x for x, ok in [(m, m in MODELS) for m in FLAGS.models] +
         [(m, m in MECHANISMS) for m in FLAGS.mechanisms] if not ok]
  if bad:
    raise app.UsageError(f'{bad[0]}: --models take {", ".join(MODELS)}; '
                         f'--mechanisms {", ".join(MECHANISMS)}.')
  try:
    grid = {'full': [int(b) for b in FLAGS.bits],
            'igc': [int(b) for b in FLAGS.igc_bits]}
  except ValueError:
    raise app.UsageError('--bits / --igc_bits: integers only.') from None
  return [_name(model, mech, b) for model in MODELS if model in FLAGS.models
          for mech, bits in [(r, [None]) for r in REFERENCES] +
          [(m, grid[model]) for m in FLAGS.mechanisms] for b in bits]


def _check_name(names: list[str]) -> str:
  """The check's row: IGC with the first mechanism at B = 16 (else its
  first B), else the first distributed row, else the first row."""
  dist = [n for n in names if _parse(n)[2] is not None]
  igc = [n for n in dist if n.startswith('igc_')]
  pick = [n for n in igc if n.endswith('_b16')] or igc or dist or names
  return pick[0]


def main(argv):
  started = provenance.start_study(argv, NAME, _report)
  if started is None:
    return
  seeds, out = started
  if FLAGS.data_dir:
    os.environ['FEDLITE_DATA_DIR'] = FLAGS.data_dir
  names = _names()
  data = {'provenance': provenance.file_provenance(),
          'meta': {'rounds': FLAGS.rounds, 'tail_evaluations': stats.TAIL,
                   'epsilon': FLAGS.epsilon, 'delta': DELTA,
                   'clip': FLAGS.clip, 'population': FLAGS.population,
                   'clients_per_round': FLAGS.clients_per_round,
                   'server_lr': FLAGS.server_lr,
                   'nodp_server_lr': FLAGS.nodp_server_lr,
                   'intrinsic_dim': femnist_setting.INTRINSIC_DIM}}
  unreachable: dict[str, dict] = {}
  runs = provenance.seed_major(
      names, seeds, lambda name, seed: _train(name, seed, unreachable))
  data['results'] = [_row(n, runs[n], seeds) for n in names
                     if n not in unreachable]
  data['unreachable'] = list(unreachable.values())
  check = _check_name([r['run'] for r in data['results']])
  data['check'] = provenance.check_record(
      _flags(check, 0, FLAGS.check_rounds, f'{FLAGS.runs_dir}/check'),
      f'{check} seed 0, {FLAGS.check_rounds} rounds')
  provenance.write_study(out, NAME, data, _report)


if __name__ == '__main__':
  app.run(main)
