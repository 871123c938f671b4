#!/usr/bin/env python3
"""Gradient inversion against full vs intrinsically compressed updates.

The small-scale version of Melas-Kyriazi & Wang (2022), "Intrinsic Gradient
Compression for Federated Learning", Appendix E / Figure 3: the attack of
Zhu et al. (2019), "Deep Leakage from Gradients" (DLG), run on a client's
single-example gradient, (a) uncompressed (the D numbers), (b) compressed to
``A^T g`` (the d numbers a client uploads; the attacker knows the public
Fastfood seed, so ``A``) at several intrinsic dimensions d, and optionally
(c) what the server decodes, ``A A^T g``.

  FEDLITE_DATA_DIR=/path/to/data python experiments/igc_privacy.py

Setup (choices the paper leaves open are flags):

* Data: real FEMNIST-105 writers (task ``emnist``; images float32
  [28, 28, 1] in [0, 1], ink = 1). ``--num_images`` clients drawn without
  replacement by ``--seed``, one random training example from each, attacked
  one at a time (batch size 1, as in DLG).
* Models, at random initialization (as in DLG, the gradient is taken at the
  first round's point): (1) ``DlgLeNet`` below, DLG's LeNet (three 5x5
  convolutions with sigmoid, a dense layer; weights and biases
  ~ U[-0.5, 0.5], DLG's ``weights_init``), adapted to 28x28x1 inputs and 62
  classes: D = 44,054; (2) the project's FEMNIST CNN
  (:func:`fedlite_jax.models.emnist.create_emnist_cnn`, relu, D = 1,206,590,
  dropout off), on ``--cnn_images`` of the same images.
* Attack: :func:`fedlite_jax.igc.privacy.gradient_inversion`, L-BFGS with a
  zoom line search for ``--attack_steps`` iterations from ``x' ~ N(0, 1)``
  (DLG's init); the relative matching loss ``||obs(x') - obs(x)||^2 /
  ||obs(x)||^2``; no image prior (``--tv_weight`` 0). ``--label_mode=known``
  (default) gives the attacker the true label in every setting (iDLG reads it
  off the full gradient exactly; for compressed updates this favours the
  attacker); ``dlg`` optimizes a soft label jointly, as in DLG. Each image
  uses the same attack initialization in every setting.
* Compression: ``A`` = Fastfood (D x d) from ``--fastfood_seed`` with the
  default ``'unit_expectation'`` scale (the scale does not change what can
  be inverted: the objective is relative).
* Metrics, on the reconstruction clipped to [0, 1]: MSE to the true image
  and PSNR = 10 log10(1 / MSE) dB; mean (and spread) over images. Also the
  iDLG label read from the observation's last-layer bias (for ``A^T g``:
  from the server's decode ``A A^T g``).

Writes ``<output_dir>/igc_privacy.md`` (tables, the commit and command that
produced it, seed, machine, load average, wall time) and ``<output_dir>/igc_privacy.png`` (original and
reconstructions, one row per image). Findings written by hand below the
marker line of the .md are kept when it is regenerated.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import platform
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
from fedlite_jax.igc import fastfood as ff
from fedlite_jax.igc import privacy
from fedlite_jax.models import emnist
import provenance

_REPO = pathlib.Path(__file__).resolve().parent.parent

flags.DEFINE_string('data_dir', os.environ.get('FEDLITE_DATA_DIR'),
                    'Directory holding femnist105/ (default: '
                    '$FEDLITE_DATA_DIR).')
flags.DEFINE_integer('seed', 0, 'Seed: image choice, model init, attack init.')
flags.DEFINE_integer('fastfood_seed', 1, 'Public Fastfood seed of A.')
flags.DEFINE_integer('num_images', 8, 'Images (one per client) for LeNet.')
flags.DEFINE_list('dims', ['256', '512', '1024', '4096', '16384', '65536'],
                  'Intrinsic dimensions d for the LeNet attacks.')
flags.DEFINE_list('decoded_dims', ['1024'],
                  'd at which to also attack the decoded update A A^T g.')
flags.DEFINE_integer('attack_steps', 200, 'L-BFGS iterations per attack.')
flags.DEFINE_enum('label_mode', 'known', ['known', 'dlg'],
                  'known: attacker has the true label; dlg: soft label '
                  'optimized jointly.')
flags.DEFINE_float('tv_weight', 0.0, 'Total-variation prior weight (DLG: 0).')
flags.DEFINE_integer('cnn_images', 2,
                     'Images for the FEMNIST CNN (0: skip the CNN).')
flags.DEFINE_list('cnn_dims', ['256', '4096', '65536'],
                  'Intrinsic dimensions d for the CNN attacks.')
flags.DEFINE_integer('cnn_attack_steps', 100,
                     'L-BFGS iterations per CNN attack.')
flags.DEFINE_string('output_dir', str(_REPO / 'experiments' / 'results'),
                    'Where igc_privacy.{md,png} go.')
FLAGS = flags.FLAGS

NUM_CLASSES = 62
IMAGE_SHAPE = (28, 28, 1)
_NOTES_MARKER = '<!-- hand-written findings below: kept when regenerating -->'


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
  """One observation: 'full', 'compressed' (A^T g) or 'decoded' (A A^T g)."""
  kind: str
  d: int | None = None

  @property
  def label(self) -> str:
    if self.kind == 'full':
      return 'full gradient g'
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

  ``transform``: what the attacker sees (None: the gradient itself);
  ``decode``: what the server reconstructs (``A A^T g``; identity for full).
  """
  if setting.kind == 'full':
    return None, lambda g: g
  a = ff.fastfood_params(seed, D, setting.d)
  decode = lambda g: ff.fastfood_lift(a, ff.fastfood_project(a, g))
  if setting.kind == 'compressed':
    return (lambda g: ff.fastfood_project(a, g)), decode
  return decode, decode


def _attack_setting(apply_fn: Callable, params: Any, setting: Setting,
                    images: np.ndarray, labels: np.ndarray, keys: jax.Array,
                    steps: int, bias_of: Callable[[Any], jax.Array]) -> dict:
  """Runs the attack on every image (vmapped) for one observation."""
  flat0, unravel = ravel_pytree(params)
  D = int(flat0.shape[0])
  transform, decode = _observation(setting, D, FLAGS.fastfood_seed)
  observe = privacy.gradient_observation(apply_fn, params, transform)
  full = privacy.gradient_observation(apply_fn, params, None)
  known = FLAGS.label_mode == 'known'

  def one(x, y, key):
    x = x[None]
    y1 = y[None]
    target = observe(x, jax.nn.one_hot(y1, NUM_CLASSES))
    # iDLG label from what the server can decode (full: exact gradient).
    g_dec = decode(full(x, jax.nn.one_hot(y1, NUM_CLASSES)))
    idlg = privacy.infer_label(bias_of(unravel(g_dec)))
    res = privacy.gradient_inversion(
        observe, target, key, x.shape, label=y1 if known else None,
        num_classes=NUM_CLASSES, num_steps=steps, tv_weight=FLAGS.tv_weight)
    rec = jnp.clip(res.x[0], 0.0, 1.0)
    return {'rec': rec, 'mse': privacy.mse(rec, x[0]),
            'psnr': privacy.psnr(rec, x[0]), 'best_loss': res.best_loss,
            'losses': res.losses,
            'label_hat': jnp.argmax(res.label_probs[0]).astype(jnp.int32),
            'idlg': idlg}

  t0 = time.perf_counter()
  out = jax.jit(jax.vmap(one))(jnp.asarray(images), jnp.asarray(labels), keys)
  out = jax.tree.map(np.asarray, out)
  out['seconds'] = time.perf_counter() - t0
  out['setting'] = setting
  out['D'] = D
  return out


def _run_model(name: str, apply_fn: Callable, params: Any,
               settings: list[Setting], images: np.ndarray,
               labels: np.ndarray, keys: jax.Array, steps: int,
               bias_of: Callable) -> list[dict]:
  results = []
  for s in settings:
    r = _attack_setting(apply_fn, params, s, images, labels, keys, steps,
                        bias_of)
    r['model'] = name
    results.append(r)
    print(f'{name:<6} {s.label:<22} MSE {r["mse"].mean():.4f}  PSNR '
          f'{r["psnr"].mean():5.1f} dB  match {np.median(r["best_loss"]):.1e}'
          f'  {r["seconds"]:.0f} s', flush=True)
  return results


def _row(r: dict, labels: np.ndarray) -> str:
  s, D = r['setting'], r['D']
  n = D if s.d is None else s.d
  ratio = '1x' if s.d is None else f'{D / s.d:.3g}x'
  mse, ps = r['mse'], r['psnr']
  label_col = (f"{int(np.sum(r['label_hat'] == labels))}/{len(labels)}"
               if FLAGS.label_mode == 'dlg' else 'given')
  return (f"| {s.label} | {n:,} | {ratio} | {mse.mean():.4f} "
          f"({mse.min():.4f}-{mse.max():.4f}) | {ps.mean():.1f} "
          f"({ps.min():.1f}-{ps.max():.1f}) | {int(np.sum(ps >= 20))}/"
          f"{len(ps)} | {np.median(r['best_loss']):.1e} | {label_col} | "
          f"{int(np.sum(r['idlg'] == labels))}/{len(labels)} | "
          f"{r['seconds']:.0f} |")


def _baselines(images: np.ndarray, keys: jax.Array) -> tuple[float, float]:
  zero = float(np.mean(np.square(images)))
  inits = np.stack([np.asarray(jax.random.normal(
      jax.random.split(k)[0], (1,) + IMAGE_SHAPE))[0] for k in keys])
  init = float(np.mean(np.square(np.clip(inits, 0, 1) - images)))
  return zero, init


def _write_md(path: pathlib.Path, lenet: list[dict], cnn: list[dict],
              images: np.ndarray, labels: np.ndarray, keys: jax.Array,
              meta: dict) -> None:
  header = ('| observation | numbers seen | compression | MSE mean (min-max) '
            '| PSNR dB mean (min-max) | PSNR >= 20 dB | median rel. match '
            '| attack label | iDLG label | s |')
  sep = '|---|---|---|---|---|---|---|---|---|---|'
  zero, init = _baselines(images, keys)
  lines = [
      '# Gradient inversion vs intrinsic gradient compression (IGC Appendix '
      'E, small scale)',
      '',
      provenance.markdown_header(meta['provenance']),
      f'Seed {FLAGS.seed} (images, models, attack init), Fastfood seed '
      f'{FLAGS.fastfood_seed}, label mode `{FLAGS.label_mode}`, '
      f'TV weight {FLAGS.tv_weight:g}. Machine: {meta["machine"]}. Load '
      f'average (1/5/15 min) at start {meta["load_start"]}, at end '
      f'{meta["load_end"]}. Wall time {meta["wall"] / 60:.1f} min (includes '
      'compilation).',
      '',
      f'Images: one random training example from each of {len(labels)} '
      'random FEMNIST-105 writers (labels '
      f'{", ".join(str(int(y)) for y in labels)}), batch size 1. Attack: '
      'DLG (Zhu et al. 2019) with L-BFGS (zoom line search), init N(0, 1), '
      'relative squared matching loss, no image prior; metrics on the '
      'reconstruction clipped to [0, 1], mean over images.',
      '',
      f'## DLG LeNet (sigmoid, D = {lenet[0]["D"]:,}), '
      f'{FLAGS.attack_steps} L-BFGS iterations, {len(labels)} images',
      '',
      header, sep,
  ] + [_row(r, labels) for r in lenet]
  if cnn:
    nc = len(cnn[0]['mse'])
    lines += [
        '',
        f'## FEMNIST CNN (relu, D = {cnn[0]["D"]:,}), '
        f'{FLAGS.cnn_attack_steps} L-BFGS iterations, first {nc} images',
        '',
        header, sep,
    ] + [_row(r, labels[:nc]) for r in cnn]
  lines += [
      '',
      f'Reference points (same images): the all-zero (blank) image has MSE '
      f'{zero:.4f} (PSNR {10 * math.log10(1 / zero):.1f} dB); the attack\'s '
      f'random initialization, clipped, has MSE {init:.4f} (PSNR '
      f'{10 * math.log10(1 / init):.1f} dB).',
      '',
      'Columns: `numbers seen`: the size of the observation (D for the full '
      'gradient, d for A^T g; A A^T g has D entries but carries the same d '
      'numbers). `PSNR >= 20 dB`: images reconstructed recognizably (a '
      'threshold chosen for this table). `median rel. match`: median over '
      'images of the final ||obs(x\') - obs(x)||^2 / ||obs(x)||^2 (small = '
      'the attacker found an input that explains the observation). `attack '
      'label`: `given` (label mode known) or the number of correct soft '
      'labels (dlg). `iDLG label`: images whose label is the argmin of the '
      'last-layer bias gradient as seen by the server (full g, or the '
      'decoded A A^T g). `s`: wall seconds for all images of the row '
      '(vmapped, compilation included).',
      '',
      'Per-image PSNR (dB), LeNet:',
      '',
      '| observation | ' + ' | '.join(f'img {i}' for i in range(len(labels)))
      + ' |',
      '|---|' + '---|' * len(labels),
  ]
  for r in lenet:
    lines.append(f'| {r["setting"].label} | '
                 + ' | '.join(f'{p:.1f}' for p in r['psnr']) + ' |')
  text = '\n'.join(lines) + '\n'
  if path.exists() and _NOTES_MARKER in path.read_text():
    text += '\n' + _NOTES_MARKER + path.read_text().split(_NOTES_MARKER, 1)[1]
  path.write_text(text)


def _plot(path: pathlib.Path, lenet: list[dict], cnn: list[dict],
          images: np.ndarray, labels: np.ndarray) -> None:
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  columns = ['original']
  for r in lenet + cnn:
    if r['setting'].label not in columns:
      columns.append(r['setting'].label)
  rows = [('LeNet', i) for i in range(len(labels))]
  if cnn:
    rows += [('CNN', i) for i in range(len(cnn[0]['mse']))]
  fig, axes = plt.subplots(len(rows), len(columns),
                           figsize=(1.25 * len(columns), 1.3 * len(rows)),
                           squeeze=False)
  by = {(r['model'], r['setting'].label): r for r in lenet + cnn}
  for ri, (model, i) in enumerate(rows):
    for ci, col in enumerate(columns):
      ax = axes[ri, ci]
      ax.set_xticks([])
      ax.set_yticks([])
      if col == 'original':
        ax.imshow(images[i, :, :, 0], cmap='gray_r', vmin=0, vmax=1)
        ax.set_ylabel(f'{model} #{i}', fontsize=7)
      elif (model, col) in by:
        r = by[(model, col)]
        ax.imshow(r['rec'][i, :, :, 0], cmap='gray_r', vmin=0, vmax=1)
        ax.set_xlabel(f'{r["psnr"][i]:.1f} dB', fontsize=6, labelpad=1)
      else:
        ax.axis('off')
      if ri == 0:
        ax.set_title(col, fontsize=6)
  fig.suptitle('DLG reconstructions (PSNR under each); rows: model #image',
               fontsize=8)
  fig.tight_layout(rect=(0, 0, 1, 0.98))
  fig.savefig(path, dpi=110)
  plt.close(fig)


def _lenet_bias(grads: Any) -> jax.Array:
  return grads['params']['Dense_0']['bias']


def _cnn_bias(grads: Any) -> jax.Array:
  return grads['server']['dense2']['bias']


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {argv[1:]}')
  prov = provenance.file_provenance()
  t0 = time.perf_counter()
  load_start = ', '.join(f'{x:.2f}' for x in os.getloadavg())
  images, labels, _ = _pick_images(FLAGS.data_dir, FLAGS.num_images,
                                   FLAGS.seed)
  root = jax.random.key(FLAGS.seed)
  keys = jax.random.split(jax.random.fold_in(root, 1), FLAGS.num_images)

  lenet = DlgLeNet()
  lenet_params = lenet.init(jax.random.fold_in(root, 0),
                            jnp.zeros((1,) + IMAGE_SHAPE))
  settings = [Setting('full')] + [Setting('compressed', int(d))
                                  for d in FLAGS.dims]
  settings += [Setting('decoded', int(d)) for d in FLAGS.decoded_dims]
  lenet_results = _run_model('LeNet', lenet.apply, lenet_params, settings,
                             images, labels, keys, FLAGS.attack_steps,
                             _lenet_bias)

  cnn_results = []
  if FLAGS.cnn_images > 0:
    m = emnist.create_emnist_cnn()
    cnn_params = m.model.init(jax.random.fold_in(root, 2))

    def cnn_apply(p, x):
      batch = {'x': x, 'y': jnp.zeros((x.shape[0],), jnp.int32)}
      return m.model.apply_for_eval(p, batch)  # Deterministic: no dropout.

    n = min(FLAGS.cnn_images, FLAGS.num_images)
    cnn_settings = [Setting('full')] + [Setting('compressed', int(d))
                                        for d in FLAGS.cnn_dims]
    cnn_results = _run_model('CNN', cnn_apply, cnn_params, cnn_settings,
                             images[:n], labels[:n], keys[:n],
                             FLAGS.cnn_attack_steps, _cnn_bias)

  wall = time.perf_counter() - t0
  meta = {
      'provenance': prov,
      'machine': (f'{platform.processor() or platform.machine()}, '
                  f'{os.cpu_count()} cores, {platform.system()}, jax '
                  f'{jax.__version__} ({jax.default_backend()})'),
      'load_start': load_start,
      'load_end': ', '.join(f'{x:.2f}' for x in os.getloadavg()),
      'wall': wall,
  }
  out = pathlib.Path(FLAGS.output_dir)
  out.mkdir(parents=True, exist_ok=True)
  _write_md(out / 'igc_privacy.md', lenet_results, cnn_results, images,
            labels, keys, meta)
  _plot(out / 'igc_privacy.png', lenet_results, cnn_results, images, labels)
  print(f'wrote {out}/igc_privacy.md and .png; wall {wall / 60:.1f} min')


if __name__ == '__main__':
  app.run(main)
