#!/usr/bin/env python3
"""Gradient inversion against full vs intrinsically compressed updates.

The small-scale version of Melas-Kyriazi & Wang (2022), "Intrinsic Gradient
Compression for Federated Learning", Appendix E / Figure 3: the attack of
Zhu et al. (2019), "Deep Leakage from Gradients" (DLG), on a client's
single-example gradient, (a) uncompressed (the D numbers), (b) compressed to
``A^T g`` (the d numbers a client uploads; the attacker knows the public
Fastfood seed, so ``A``) at several intrinsic dimensions d, and (c) what the
server decodes, ``A A^T g``, and (d) the full gradient as DP-FedAvg
releases it (McMahan et al. 2018, Alg. 1): clipped to L2 norm ``C`` and
noised with std ``z * C``; each without and with a total-variation image
prior (Geiping et al. 2020), over seeds.

  FEDLITE_DATA_DIR=/path/to/data python experiments/igc_privacy.py

Setup (choices the paper leaves open are flags):

* Data: real FEMNIST-105 writers (images float32 [28, 28, 1] in [0, 1]).
  Per seed, ``--images_per_seed`` writers drawn without replacement, one
  random training example from each, attacked one at a time (batch size 1,
  as in DLG). Seeds 0-3 x 4 images = 16 images by default.
* Models at random initialization (the seed's), as in DLG: ``DlgLeNet``
  (DLG's LeNet, sigmoid, D = 44,054) and the project's FEMNIST CNN (relu,
  D = 1,206,590, dropout off) on ``--cnn_images_per_seed`` of the images.
* Attack: :func:`gradient_inversion.gradient_inversion` (beside this file,
  ``experiments/gradient_inversion.py``), L-BFGS for
  ``--attack_steps`` iterations from ``x' ~ N(0, 1)``, relative matching
  loss, plus ``tv_weight * TV(x')`` for each of ``--tv_weights``;
  ``--label_mode=known`` gives the attacker the true label. An image uses the
  same attack initialization in every setting.
* DP row: ``clip(g, C) + N(0, (z C)^2 I)`` with ``C = --dp_clip_norm``,
  ``z = --dp_noise_multiplier`` (``fedlite_jax.privacy``: ``clip_by_global_norm``,
  ``gaussian_noise_like``, ``noise_std_on_sum``). This is the per-client
  view of central DP's noise on the sum: a cohort of size 1, so the noise
  std on the released update is ``z * C`` (in a cohort of n the noise on the
  mean is ``z * C / n``, but n - 1 other updates are summed in as well).
  The attacker knows ``C`` and matches the clipped gradient of its
  candidate; the noise of image i is drawn from
  ``split(fold_in(key(seed), 3), n)[i]``. The iDLG label is read from the
  noised update (what the server receives).
* Metrics on the reconstruction clipped to [0, 1]: PSNR = 10 log10(1 / MSE)
  dB; per seed the mean over its images, then mean ± std over seeds; images
  at >= 20 dB counted as recognizable; the iDLG label read from the
  observation's decoded last-layer bias.

Writes ``igc_privacy.json`` (rows under ``results``, each with its ``seeds``
and per-image values; paired comparisons; a ``check`` that re-runs a
compressed row and the DP row on one image), ``igc_privacy.md`` and two
figures: PSNR by d (``igc_privacy.png``) and the reconstructions of seed 0
(``igc_privacy_images.png``). ``--report_only`` rewrites the .md and figures
from the JSON; ``--check`` runs only the check configuration and writes
``<output_dir>/check.json``; ``--add_missing_rows`` runs only the rows the
stored JSON lacks (same seeds and settings), inserts them in table order,
records their command and commit under ``added_rows``, re-runs the check
and rewrites the .md and the PSNR figure (the reconstructions figure stays
as stored).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import time
from typing import Any, Callable

from absl import app
from absl import flags

import fedlite_jax  # noqa: F401  (FedJAX compatibility first)
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree

from fedlite_jax.datasets import load_federated_data
from fedlite_jax.transforms import fastfood as ff
from fedlite_jax.models import emnist
from fedlite_jax.privacy import global_norm
from fedlite_jax.privacy import noise_std_on_sum
import gradient_inversion as privacy
import provenance
import stats

flags.DEFINE_string('data_dir', os.environ.get('FEDLITE_DATA_DIR'),
                    'Directory holding femnist105/ (default: '
                    '$FEDLITE_DATA_DIR).')
provenance.define_study_flags('igc_privacy', (0, 1, 2, 3))
flags.DEFINE_integer('images_per_seed', 4, 'Images (one per writer) per seed '
                     'for LeNet.', lower_bound=1)
flags.DEFINE_integer('fastfood_seed', 1, 'Public Fastfood seed of A.')
flags.DEFINE_list('dims', ['256', '512', '768', '1024', '2048', '4096'],
                  'Intrinsic dimensions d for the LeNet attacks.')
flags.DEFINE_list('decoded_dims', ['1024'],
                  'd at which to also attack the decoded update A A^T g.')
flags.DEFINE_list('tv_weights', ['0', '1e-3'],
                  'Total-variation prior weights (0: DLG, no prior).')
flags.DEFINE_integer('attack_steps', 200, 'L-BFGS iterations per attack.',
                     lower_bound=1)
flags.DEFINE_enum('label_mode', 'known', ['known', 'dlg'],
                  'known: attacker has the true label; dlg: soft label '
                  'optimized jointly.')
flags.DEFINE_integer('cnn_images_per_seed', 1, 'Images per seed for the '
                     'FEMNIST CNN (0: skip the CNN), without the TV prior.',
                     lower_bound=0)
flags.DEFINE_list('cnn_dims', ['256', '4096', '65536'],
                  'Intrinsic dimensions d for the CNN attacks.')
flags.DEFINE_integer('cnn_attack_steps', 100,
                     'L-BFGS iterations per CNN attack.', lower_bound=1)
flags.DEFINE_float('dp_clip_norm', 1.0, 'DP row: clip norm C of the LeNet '
                   'gradient (public).', lower_bound=0.0)
flags.DEFINE_float('dp_noise_multiplier', 1.0, 'DP row: noise multiplier z; '
                   'noise std z * C per entry (cohort of 1).', lower_bound=0.0)
flags.DEFINE_bool('add_missing_rows', False, 'Run only the rows missing from '
                  'the stored <output_dir>/igc_privacy.json and merge them.')
flags.DEFINE_bool('check', False, 'Write only <output_dir>/check.json (the '
                  'per-image values of every row), no report.')
FLAGS = flags.FLAGS

#: The check: a compressed row and the DP row, one image, few iterations
#: (~1 minute).
CHECK_FLAGS = ('--seeds=0', '--images_per_seed=1', '--dims=1024',
               '--decoded_dims=', '--tv_weights=0', '--attack_steps=20',
               '--cnn_images_per_seed=0')
RECOGNIZABLE_DB = 20.0

NUM_CLASSES = 62
IMAGE_SHAPE = (28, 28, 1)


def _uniform_half(key: jax.Array, shape, dtype=jnp.float32) -> jax.Array:
  """U[-0.5, 0.5]: DLG's ``weights_init`` for every weight and bias."""
  return jax.random.uniform(key, shape, dtype, -0.5, 0.5)


class DlgLeNet(nn.Module):
  """DLG's LeNet (Zhu et al. 2019, reference code ``models/vision.py``).

  x float32 [B, 28, 28, 1] -> conv 12 5x5 stride 2 pad 2, sigmoid -> conv 12
  5x5 stride 2 pad 2, sigmoid -> conv 12 5x5 stride 1 pad 2, sigmoid ->
  flatten (7 * 7 * 12 = 588) -> dense num_classes: logits float32 [B, C].
  Smooth (sigmoid) activations are what makes DLG converge well.

  Attributes:
    num_classes: C (62 for FEMNIST).
  """
  num_classes: int = NUM_CLASSES

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    for stride in (2, 2, 1):
      x = nn.Conv(12, (5, 5), strides=stride, padding=2,
                  kernel_init=_uniform_half, bias_init=_uniform_half)(x)
      x = nn.sigmoid(x)
    x = x.reshape((x.shape[0], -1))
    return nn.Dense(self.num_classes, kernel_init=_uniform_half,
                    bias_init=_uniform_half)(x)


@dataclasses.dataclass(frozen=True)
class Setting:
  """One observation: 'full', 'compressed' (A^T g), 'decoded' (A A^T g) or
  'dp' (clip(g, C) + N(0, (z C)^2 I); ``clip_norm`` C and
  ``noise_multiplier`` z)."""
  kind: str
  d: int | None = None
  clip_norm: float | None = None
  noise_multiplier: float | None = None

  @property
  def label(self) -> str:
    if self.kind == 'full':
      return 'full gradient g'
    if self.kind == 'dp':
      return (f'clip(g, C={self.clip_norm:g}) + N(0, (zC)^2), '
              f'z={self.noise_multiplier:g}')
    if self.kind == 'compressed':
      return f'A^T g, d={self.d:,}'
    return f'A A^T g, d={self.d:,}'


def _pick_images(data_dir: str | None, n: int, seed: int):
  """n (image, label, client id) from n distinct random FEMNIST writers."""
  train, _, _ = load_federated_data('emnist', data_dir)
  rng = np.random.default_rng(seed)
  ids = list(train.client_ids())
  chosen = [ids[i] for i in rng.choice(len(ids), size=n, replace=False)]
  images, labels = [], []
  for _, ds in train.get_clients(chosen):
    ex = ds.all_examples()
    j = int(rng.integers(len(ex['y'])))
    images.append(ex['x'][j].astype(np.float32))
    labels.append(int(ex['y'][j]))
  return np.stack(images), np.asarray(labels, np.int32), chosen


def _observation(setting: Setting, D: int, seed: int):
  """(transform, decode) of the flattened gradient for one setting.

  ``transform``: what the attacker sees (None: the gradient itself; for
  'dp' clipping and noise are added by :func:`_attack_setting`);
  ``decode``: what the server reconstructs (``A A^T g``; identity for full).
  """
  if setting.kind in ('full', 'dp'):
    return None, lambda g: g
  a = ff.fastfood_params(seed, D, setting.d)
  decode = lambda g: ff.fastfood_lift(a, ff.fastfood_project(a, g))
  if setting.kind == 'compressed':
    return (lambda g: ff.fastfood_project(a, g)), decode
  return decode, decode


def _attack_setting(apply_fn: Callable, params: Any, setting: Setting,
                    tv_weight: float, images: np.ndarray, labels: np.ndarray,
                    keys: jax.Array, steps: int,
                    bias_of: Callable[[Any], jax.Array],
                    noise_keys: jax.Array) -> dict:
  """The attack on every image (vmapped) for one observation: per-image
  PSNR, MSE, final matching loss, iDLG and soft-label correctness, and the
  reconstructions ('dp': also the gradient norm before clipping)."""
  flat0, unravel = ravel_pytree(params)
  D = int(flat0.shape[0])
  transform, decode = _observation(setting, D, FLAGS.fastfood_seed)
  observe = privacy.gradient_observation(apply_fn, params, transform)
  full = privacy.gradient_observation(apply_fn, params, None)
  known = FLAGS.label_mode == 'known'
  dp = setting.kind == 'dp'
  if dp:
    # Central DP's noise on the sum of a cohort of 1: std z * C.
    std = noise_std_on_sum(setting.clip_norm, setting.noise_multiplier, 1)
    observe, noised = privacy.clipped_noised_observation(
        observe, setting.clip_norm, std)

  def one(x, y, key, noise_key):
    x, y1 = x[None], y[None]
    extra = {}
    if dp:
      target = noised(x, jax.nn.one_hot(y1, NUM_CLASSES), noise_key)
      g_dec = target  # The server receives the noised update.
      extra['grad_norm'] = global_norm(full(x, jax.nn.one_hot(y1,
                                                              NUM_CLASSES)))
    else:
      target = observe(x, jax.nn.one_hot(y1, NUM_CLASSES))
      # iDLG label from what the server can decode (full: exact gradient).
      g_dec = decode(full(x, jax.nn.one_hot(y1, NUM_CLASSES)))
    idlg = privacy.infer_label(bias_of(unravel(g_dec)))
    res = privacy.gradient_inversion(
        observe, target, key, x.shape, label=y1 if known else None,
        num_classes=NUM_CLASSES, num_steps=steps, tv_weight=tv_weight)
    rec = jnp.clip(res.x[0], 0.0, 1.0)
    return {'rec': rec, 'mse': privacy.mse(rec, x[0]),
            'psnr': privacy.psnr(rec, x[0]), 'best_loss': res.best_loss,
            'label_ok': jnp.argmax(res.label_probs[0]) == y,
            'idlg_ok': idlg == y, **extra}

  t0 = time.perf_counter()
  out = jax.jit(jax.vmap(one))(jnp.asarray(images), jnp.asarray(labels), keys,
                               noise_keys)
  out = {k: np.asarray(v) for k, v in out.items()}
  return {'D': D, 'seconds': time.perf_counter() - t0, 'rec': out.pop('rec'),
          **{k: v.tolist() for k, v in out.items()}}


def _lenet_bias(grads: Any) -> jax.Array:
  return grads['params']['Dense_0']['bias']


def _cnn_bias(grads: Any) -> jax.Array:
  return grads['server']['dense2']['bias']


def _rows_spec() -> list[tuple[str, Setting, float]]:
  """(model, setting, tv weight) of every row, in table order."""
  lenet = [Setting('full')] + [Setting('compressed', int(d))
                               for d in FLAGS.dims]
  lenet += [Setting('decoded', int(d)) for d in FLAGS.decoded_dims if d]
  lenet += [Setting('dp', clip_norm=FLAGS.dp_clip_norm,
                    noise_multiplier=FLAGS.dp_noise_multiplier)]
  rows = [('LeNet', s, float(tv)) for tv in FLAGS.tv_weights for s in lenet]
  if FLAGS.cnn_images_per_seed:
    rows += [('CNN', s, 0.0) for s in [Setting('full')] + [
        Setting('compressed', int(d)) for d in FLAGS.cnn_dims]]
  return rows


def _row_name(model: str, setting: Setting, tv: float) -> str:
  if setting.kind == 'dp':
    return (f'{model}|dp|C{setting.clip_norm:g}z{setting.noise_multiplier:g}'
            f'|{tv:g}')
  return f'{model}|{setting.kind}|{setting.d}|{tv:g}'


def _run_seed(seed: int, spec) -> tuple[dict[str, dict], dict]:
  """Every row's attack on this seed's images; and seed 0-style extras
  (images, reconstructions, reference points) for the report."""
  n = FLAGS.images_per_seed
  images, labels, _ = _pick_images(FLAGS.data_dir, n, seed)
  root = jax.random.key(seed)
  keys = jax.random.split(jax.random.fold_in(root, 1), n)
  noise_keys = jax.random.split(jax.random.fold_in(root, 3), n)
  lenet = DlgLeNet()
  models = {'LeNet': (lenet.apply, lenet.init(jax.random.fold_in(root, 0),
                                              jnp.zeros((1,) + IMAGE_SHAPE)),
                      n, FLAGS.attack_steps, _lenet_bias)}
  if FLAGS.cnn_images_per_seed:
    m = emnist.create_emnist_cnn()

    def cnn_apply(p, x):  # Deterministic: no dropout.
      return m.model.apply_for_eval(
          p, {'x': x, 'y': jnp.zeros((x.shape[0],), jnp.int32)})

    models['CNN'] = (cnn_apply, m.model.init(jax.random.fold_in(root, 2)),
                     min(FLAGS.cnn_images_per_seed, n), FLAGS.cnn_attack_steps,
                     _cnn_bias)
  out, recs = {}, {}
  for model, setting, tv in spec:
    apply_fn, params, k, steps, bias_of = models[model]
    r = _attack_setting(apply_fn, params, setting, tv, images[:k], labels[:k],
                        keys[:k], steps, bias_of, noise_keys[:k])
    recs[_row_name(model, setting, tv)] = r.pop('rec')
    out[_row_name(model, setting, tv)] = {'seed': seed, **r}
    print(f'seed {seed} {model:<5} {setting.label:<20} tv {tv:g}: PSNR '
          f'{np.mean(r["psnr"]):5.1f} dB, match '
          f'{np.median(r["best_loss"]):.1e}, {r["seconds"]:.0f} s', flush=True)
  inits = np.stack([np.asarray(jax.random.normal(
      jax.random.split(k)[0], (1,) + IMAGE_SHAPE))[0] for k in keys])
  extras = {'images': images, 'recs': recs, 'labels': labels.tolist(),
            'zero_mse': float(np.mean(np.square(images))),
            'init_mse': float(np.mean(np.square(np.clip(inits, 0, 1) -
                                                 images)))}
  return out, extras


def _aggregate(spec, per_seed: dict[int, dict[str, dict]]) -> list[dict]:
  seeds = sorted(per_seed)
  rows = []
  for model, setting, tv in spec:
    name = _row_name(model, setting, tv)
    runs = [per_seed[s][name] for s in seeds]
    images = [p for r in runs for p in r['psnr']]
    D = runs[0]['D']
    rows.append({
        'run': name, 'model': model, 'observation': setting.kind,
        'd': setting.d, 'tv_weight': tv, 'D': D,
        'label': f'{model}, {setting.label}' + (f', TV {tv:g}' if tv else ''),
        'numbers_seen': D if setting.d is None else setting.d,
        'compression': 1.0 if setting.d is None else D / setting.d,
        'seeds': seeds, 'images': len(images),
        'psnr': stats.summarize([float(np.mean(r['psnr'])) for r in runs]),
        'recognizable': int(sum(p >= RECOGNIZABLE_DB for p in images)),
        'idlg_correct': int(sum(sum(r['idlg_ok']) for r in runs)),
        'median_match': float(np.median([b for r in runs
                                         for b in r['best_loss']])),
        'runs': runs})
    if setting.kind == 'dp':
      norms = [v for r in runs for v in r['grad_norm']]
      rows[-1].update({
          'clip_norm': setting.clip_norm,
          'noise_multiplier': setting.noise_multiplier,
          'noise_std': float(noise_std_on_sum(
              setting.clip_norm, setting.noise_multiplier, 1)),
          'median_grad_norm': float(np.median(norms)),
          'clipped': int(sum(v > setting.clip_norm for v in norms))})
  return rows


def _comparisons(rows: list[dict]) -> list[dict]:
  """TV prior minus none, per LeNet observation (paired by seed)."""
  by = {r['run']: r for r in rows}
  out = []
  tvs = [float(t) for t in FLAGS.tv_weights]
  for r in rows:
    if r['model'] != 'LeNet' or r['tv_weight'] != tvs[0]:
      continue
    for tv in tvs[1:]:
      other = by.get(r['run'].rsplit('|', 1)[0] + f'|{tv:g}')
      if other:
        per = lambda row: {x['seed']: float(np.mean(x['psnr']))
                           for x in row['runs']}
        out.append({'label': f'{other["label"]} minus {r["label"]}',
                    'a': other['run'], 'b': r['run'],
                    **stats.paired(per(other), per(r))})
  return out


def _report(data: dict, out: pathlib.Path) -> None:
  rows = data['results']
  m = data['meta']
  n_img = rows[0]['images']
  lines = [
      '# Gradient inversion vs intrinsic gradient compression (IGC Appendix '
      'E, small scale)', '', provenance.markdown_header(data['provenance']),
      f'Seeds {", ".join(map(str, m["seeds"]))}; per seed '
      f'{m["images_per_seed"]} FEMNIST-105 writers, one random training '
      'image each (batch size 1), the model at the seed\'s random '
      f'initialization; {n_img} LeNet images in all. Attack: DLG (Zhu et al. '
      f'2019), L-BFGS, {m["attack_steps"]} iterations (CNN: '
      f'{m["cnn_attack_steps"]}), init N(0, 1), label known, relative '
      'matching loss plus TV weight x TV(x\'). Fastfood seed '
      f'{m["fastfood_seed"]}. PSNR of the reconstruction clipped to [0, 1]: '
      'mean over a seed\'s images, then mean ± std over seeds. Reference '
      f'points (seed {m["seeds"][0]}\'s images): a blank image scores '
      f'{m["zero_psnr"]:.1f} dB, the attack\'s clipped random start '
      f'{m["init_psnr"]:.1f} dB.', '',
      *_added_lines(data),
      '| row | numbers seen | compression | PSNR dB | images >= 20 dB | '
      'iDLG label | median rel. match |', '|---|---|---|---|---|---|---|']
  for r in rows:
    lines.append(
        f'| {r["label"]} | {r["numbers_seen"]:,} | {r["compression"]:.3g}x | '
        f'{stats.fmt(r["psnr"], 1)} | {r["recognizable"]}/{r["images"]} | '
        f'{r["idlg_correct"]}/{r["images"]} | {r["median_match"]:.1e} |')
  lines += _dp_lines(rows)
  lines += ['', '| comparison (paired by seed) | PSNR difference (dB) |',
            '|---|---|']
  lines += [f'| {c["label"]} | {stats.fmt_paired(c, 1)} |'
            for c in data['comparisons']]
  lines += [
      '', 'Columns: `numbers seen`: D for the full gradient, d for A^T g '
      '(A A^T g has D entries but carries the same d numbers). `images >= '
      '20 dB`: reconstructions counted as recognizable (a threshold chosen '
      'for this table). `iDLG label`: images whose label is the argmin of '
      'the last-layer bias gradient the server decodes. `median rel. '
      'match`: median final ||obs(x\') - obs(x)||^2 / ||obs(x)||^2.', '',
      '![PSNR by d](igc_privacy.png)', '',
      'Figure 1: LeNet reconstruction PSNR against the intrinsic dimension '
      'd of the observed A^T g, without and with the TV prior; mean over '
      'seeds with error bars of ± one standard deviation; dashed: the full '
      'gradient. The input has 28 x 28 = 784 pixels.', '',
      '![reconstructions](igc_privacy_images.png)', '',
      f'Figure 2: seed {m["seeds"][0]}\'s images and their LeNet '
      'reconstructions per observation (PSNR under each)' +
      ('; rows added later (above) are not in it.' if data.get('added_rows')
       else '.'), '']
  (out / 'igc_privacy.md').write_text(
      provenance.results_md(lines, data.get('check', {})))
  _plot_psnr(rows, out / 'igc_privacy.png')


def _added_lines(data: dict) -> list[str]:
  """Header paragraphs naming the command and commit of rows added later."""
  lines = []
  for add in data.get('added_rows', []):
    dirty = ' (dirty)' if add['dirty'] else ''
    lines += [f'Rows {", ".join(add["rows"])} were added at commit '
              f'`{add["commit"]}`{dirty} on {add["utc"]} by:', '',
              f'    {add["command"]}', '']
  return lines


def _dp_lines(rows: list[dict]) -> list[str]:
  """One paragraph per DP row: what was released and how often it was
  clipped."""
  lines, seen = [], set()
  for r in rows:
    key = (r['model'], r.get('clip_norm'), r.get('noise_multiplier'))
    if r['observation'] != 'dp' or key in seen:
      continue
    seen.add(key)
    lines += ['', f'{r["model"]}, clip(g, C={r["clip_norm"]:g}) + N(0, '
              f'(zC)^2), z={r["noise_multiplier"]:g} (with and without the '
              'TV prior): DP-FedAvg\'s release of this client\'s gradient '
              '(McMahan et al. 2018, Alg. 1) viewed as a cohort of 1: clipped '
              f'to L2 norm C = {r["clip_norm"]:g} ({r["clipped"]}/'
              f'{r["images"]} gradients were above C; median norm before '
              f'clipping {r["median_grad_norm"]:.3g}), plus N(0, '
              f'{r["noise_std"]:g}^2) on each of the {r["D"]:,} entries (std '
              f'z C; the noise has norm about sqrt(D) z C = '
              f'{np.sqrt(r["D"]) * r["noise_std"]:.3g}); the attacker knows C '
              'and matches its candidate\'s clipped gradient; the iDLG label '
              'is read from the noised update.']
  return lines


def _plot_psnr(rows: list[dict], path: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, ax = plt.subplots(figsize=(6.5, 4.2))
  for tv in sorted({r['tv_weight'] for r in rows if r['model'] == 'LeNet'}):
    pts = sorted((r['d'], r['psnr']) for r in rows if r['model'] == 'LeNet'
                 and r['tv_weight'] == tv and r['observation'] == 'compressed')
    name = 'no prior' if tv == 0 else f'TV prior {tv:g}'
    line = ax.errorbar([d for d, _ in pts], [p['mean'] for _, p in pts],
                       yerr=[p['std'] for _, p in pts], marker='o', ms=4,
                       capsize=3, label=f'A^T g, {name}')
    full = next(r for r in rows if r['model'] == 'LeNet' and
                r['tv_weight'] == tv and r['observation'] == 'full')
    ax.axhline(full['psnr']['mean'], ls='--', color=line[0].get_color(),
               label=f'full gradient, {name}')
  ax.axvline(784, color='gray', lw=0.8)
  ax.axhline(RECOGNIZABLE_DB, color='gray', lw=0.8, ls=':')
  ax.set(xscale='log', xlabel='intrinsic dimension d (numbers uploaded)',
         ylabel='reconstruction PSNR (dB)',
         title='DLG on LeNet (FEMNIST): mean ± std over seeds')
  ax.legend(fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _plot_images(extras: dict, rows: list[dict], path: pathlib.Path) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  cols = [r for r in rows if r['model'] == 'LeNet']
  images = extras['images']
  fig, axes = plt.subplots(len(images), len(cols) + 1, squeeze=False,
                           figsize=(1.0 * (len(cols) + 1), 1.2 * len(images)))
  for i in range(len(images)):
    axes[i, 0].imshow(images[i, :, :, 0], cmap='gray_r', vmin=0, vmax=1)
    for j, r in enumerate(cols, 1):
      axes[i, j].imshow(extras['recs'][r['run']][i, :, :, 0], cmap='gray_r',
                        vmin=0, vmax=1)
      axes[i, j].set_xlabel(f'{r["runs"][0]["psnr"][i]:.1f}', fontsize=6,
                            labelpad=1)
    for j, title in enumerate(['original'] + [
        r['label'].replace('LeNet, ', '').replace(', TV', '\nTV')
        for r in cols]):
      axes[0, j].set_title(title, fontsize=5)
    for ax in axes[i]:
      ax.set_xticks([])
      ax.set_yticks([])
  fig.suptitle('DLG reconstructions of LeNet gradients (PSNR dB under each)',
               fontsize=8)
  fig.tight_layout(rect=(0, 0, 1, 0.97))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _check_record() -> dict:
  """Runs the check configuration (``CHECK_FLAGS``): the JSON's ``check``."""
  rel = f'{FLAGS.runs_dir}/check'
  rec = provenance.run_script('experiments/igc_privacy.py', [
      '--check', *CHECK_FLAGS, f'--output_dir={rel}'])
  return {
      'label': 'LeNet, A^T g d=1,024 and the DP row, seed 0, one image, 20 '
               'iterations',
      'command': rec['command'], 'commit': rec['commit'],
      'dirty': rec['dirty'],
      'rows': json.loads((provenance.REPO / rel / 'check.json').read_text())[
          'rows']}


def _stored_for_merge(path: pathlib.Path, seeds: list[int], spec) -> dict:
  """The stored study, if its setup matches these flags (else UsageError)."""
  stored = json.loads(path.read_text())
  m = stored['meta']
  now = {'seeds': seeds, 'images_per_seed': FLAGS.images_per_seed,
         'attack_steps': FLAGS.attack_steps,
         'cnn_attack_steps': FLAGS.cnn_attack_steps,
         'fastfood_seed': FLAGS.fastfood_seed, 'label_mode': FLAGS.label_mode}
  differ = [k for k, v in now.items() if m.get(k) != v]
  names = {_row_name(*s) for s in spec}
  extra = [r['run'] for r in stored['results'] if r['run'] not in names]
  if differ or extra:
    raise app.UsageError(f'--add_missing_rows: {path} has other settings '
                         f'({differ}) or rows these flags do not make '
                         f'({extra}).')
  return stored


def main(argv):
  started = provenance.start_study(argv, 'igc_privacy', _report)
  if started is None:
    return
  seeds, out = started
  prov = provenance.file_provenance()  # At the start: commit and time.
  spec = _rows_spec()
  stored = None
  if FLAGS.add_missing_rows:
    stored = _stored_for_merge(out / 'igc_privacy.json', seeds, spec)
    have = {r['run'] for r in stored['results']}
    spec_run = [s for s in spec if _row_name(*s) not in have]
  else:
    spec_run = spec
  per_seed, extras = {}, None
  for seed in seeds:
    per_seed[seed], ex = _run_seed(seed, spec_run)
    extras = extras or ex
  rows = _aggregate(spec_run, per_seed)
  out.mkdir(parents=True, exist_ok=True)
  if FLAGS.check:
    provenance.write_json(out / 'check.json', {'rows': [
        {'run': r['run'], 'psnr': [p for x in r['runs'] for p in x['psnr']],
         'best_loss': [b for x in r['runs'] for b in x['best_loss']]}
        for r in rows]})
    return
  if stored is not None:
    new = {r['run']: r for r in rows}
    old = {r['run']: r for r in stored['results']}
    data = {**stored, 'results': [old.get(n) or new[n] for n in
                                  (_row_name(*s) for s in spec)]}
    data['added_rows'] = stored.get('added_rows', []) + [
        {'rows': [r['run'] for r in rows], **prov}]
    data['comparisons'] = _comparisons(data['results'])
    data['check'] = _check_record()
    provenance.write_study(out, 'igc_privacy', data, _report)
    return
  data = {'provenance': prov,
          'meta': {'seeds': seeds, 'images_per_seed': FLAGS.images_per_seed,
                   'attack_steps': FLAGS.attack_steps,
                   'cnn_attack_steps': FLAGS.cnn_attack_steps,
                   'fastfood_seed': FLAGS.fastfood_seed,
                   'label_mode': FLAGS.label_mode,
                   'zero_psnr': float(-10 * np.log10(extras['zero_mse'])),
                   'init_psnr': float(-10 * np.log10(extras['init_mse']))},
          'results': rows}
  data['comparisons'] = _comparisons(rows)
  data['check'] = _check_record()
  _plot_images(extras, rows, out / 'igc_privacy_images.png')
  provenance.write_study(out, 'igc_privacy', data, _report)


if __name__ == '__main__':
  app.run(main)
