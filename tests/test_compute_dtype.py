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


def _lane_segment(model, batch, lanes=3, slots=2, steps=2):
  """The vmap engine's ``lanes_segment`` of the runner's FedAvg client
  update for ``model``, lowered from abstract shapes."""
  import optax  # pylint: disable=g-import-not-at-top
  from fedlite_jax.algorithms import fedopt  # pylint: disable=g-import-not-at-top
  from fedlite_jax.algorithms import rounds_common as rc  # pylint: disable=g-import-not-at-top
  from fedlite_jax.rounds import lane_programs  # pylint: disable=g-import-not-at-top
  from fedlite_jax.rounds import sharding  # pylint: disable=g-import-not-at-top
  params = jax.eval_shape(model.init, jax.random.PRNGKey(0))
  r = fedopt.CompressedRound(fedopt.Compression(), 'fedavg', 0, 'examples',
                             'dense', None, 'raise')
  r.setup(params)
  prog = rc.delta_client_program(rc.train_grad(model), optax.sgd(0.1),
                                 r.compress, plan=r.plan)
  key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
  lead = lambda t, *d: jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(d + s.shape, s.dtype), t)
  shared = {'params': params}
  states = jax.eval_shape(jax.vmap(prog.init, in_axes=(None, 0)), shared,
                          lead({'rng': key}, lanes))
  acc = lead(jax.eval_shape(prog.final, shared, jax.tree.map(
      lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), states))[0], 1)
  flags = lambda n: jax.ShapeDtypeStruct((n, steps), jnp.bool_)
  inputs = lane_programs.StepInputs(
      batch=lead(batch, lanes, steps), active=flags(lanes),
      fin_lane=jax.ShapeDtypeStruct((slots, steps), jnp.int32),
      fin_weight=jax.ShapeDtypeStruct((slots, steps), jnp.float32),
      start_input=lead({'rng': key}, slots, steps), start_on=flags(slots))
  segment = lane_programs.build_lane_programs(
      prog.init, lambda s, b: (prog.step(s, b), None), prog.final,
      mesh=sharding.make_client_mesh(1), segment_steps=steps).segment
  return segment.lower(shared, states, acc, inputs,
                       jax.ShapeDtypeStruct((), jnp.int32))


@pytest.mark.parametrize('kind', ['cnn_im2col', 'transformer_tiny'])
def test_lane_programs_multiply_in_bf16(kind):
  """Every matmul (dot_general) and convolution of the model's step in the
  vmap engine's lane segment (operands batched over lanes and examples:
  rank >= 3) takes bf16 operands under bf16 compute, and float32 ones
  without (so the check can fail); the finalization's float32 delta norms
  (rank 2) stay float32."""
  import re  # pylint: disable=g-import-not-at-top
  if kind.startswith('cnn'):
    make = lambda dtype: emnist.create_emnist_cnn(
        conv_implementation='im2col', compute_dtype=dtype).model
    batch = {'x': jax.ShapeDtypeStruct((4, 28, 28, 1), jnp.float32),
             'y': jax.ShapeDtypeStruct((4,), jnp.int32)}
  else:
    make = lambda dtype: lm.create_lm(kind, 64, max_length=10,
                                      compute_dtype=dtype).model
    batch = {k: jax.ShapeDtypeStruct((4, 10), jnp.int32) for k in 'xy'}
  for dtype, want in ((jnp.bfloat16, 'bf16'), (None, 'f32')):
    text = _lane_segment(make(dtype), batch).as_text()
    ops = re.findall(r'stablehlo\.(?:dot_general|convolution)[^\n]*', text)
    operands = [re.findall(r'tensor<([^>]*)>', op)[:2] for op in ops]
    model = [(op, o) for op, o in zip(ops, operands)
             if max(x.count('x') for x in o) >= 3]
    assert len(model) >= 4, text[:2000]
    for op, o in model:
      assert all(x.endswith(want) for x in o), (dtype, op)
