"""Mixed precision (``--compute_dtype=bfloat16``): bf16 arithmetic, float32
state.

References: the float32 model (same parameters) for the loss to bf16
rounding (relative 2e-2); the lowered HLO for bf16 matmuls/convolutions;
the dtypes of parameters, gradients, client deltas and server state, which
must stay float32.
"""

from __future__ import annotations

import fedlite_jax  # noqa: F401
import fedjax
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlite_jax.models import emnist
from fedlite_jax.models import lm
from fedlite_jax.training import RunConfig
from fedlite_jax.training import run


def _cnn_batch():
  rng = np.random.RandomState(0)
  return {'x': rng.rand(8, 28, 28, 1).astype(np.float32),
          'y': rng.randint(0, 62, 8).astype(np.int32)}


def _lm_batch():
  rng = np.random.RandomState(1)
  tokens = rng.randint(4, 64, (4, 11)).astype(np.int32)
  return {'x': tokens[:, :-1], 'y': tokens[:, 1:]}


@pytest.mark.parametrize('kind', ['cnn_lax', 'cnn_im2col',
                                  'transformer_tiny', 'lstm_tiny'])
def test_bf16_computes_in_bf16_and_keeps_float32_state(kind):
  if kind.startswith('cnn'):
    make = lambda dtype: emnist.create_emnist_cnn(
        conv_implementation=kind.split('_')[1], compute_dtype=dtype).model
    batch = _cnn_batch()
  else:
    make = lambda dtype: lm.create_lm(kind, 64, max_length=10,
                                      compute_dtype=dtype).model
    batch = _lm_batch()
  ref, mixed = make(None), make(jnp.bfloat16)
  params = ref.init(jax.random.PRNGKey(0))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(
      mixed.init(jax.random.PRNGKey(0))))
  logits = mixed.apply_for_eval(params, batch)
  assert logits.dtype == jnp.float32
  loss = lambda m: float(jnp.mean(m.train_loss(batch, m.apply_for_eval(
      params, batch))))
  assert loss(mixed) == pytest.approx(loss(ref), rel=2e-2)
  assert loss(mixed) != loss(ref)  # bf16 arithmetic really happened.
  grads = fedjax.model_grad(mixed)(params, batch, jax.random.PRNGKey(1))
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))
  text = jax.jit(mixed.apply_for_eval).lower(params, batch).as_text()
  assert 'bf16' in text


def test_runner_bf16_run_keeps_float32_server_state(tmp_path):
  common = dict(task='embedded_mnist', num_rounds=2, clients_per_round=7,
                client_batch_size=20, max_examples_per_client=40,
                eval_every=2, eval_num_clients=5, progress=False,
                checkpoint_every=0)
  f32 = run(RunConfig(output_dir=str(tmp_path / 'f32'), **common))
  bf16 = run(RunConfig(output_dir=str(tmp_path / 'bf16'),
                       compute_dtype='bfloat16', **common))
  assert bf16['engine']['compute_dtype'] == 'bfloat16'
  assert bf16['flags']['compute_dtype'] == 'bfloat16'
  assert bf16['communication'] == f32['communication']  # float32 messages
  assert bf16['final_eval']['loss'] == pytest.approx(
      f32['final_eval']['loss'], rel=5e-2)
  assert bf16['final_eval']['loss'] != f32['final_eval']['loss']
