"""Stage strings (transforms.parse_chain), read-only transform state, flags.

Independent expectations: message sizes from the papers' formulas (IGC:
``32 d`` coordinates then ``b d + 64`` after b-bit quantization; top-k:
``k (32 + ceil(log2 D))``), the transforms built by hand for the same
stages (same key -> same message), and the runner's stage flags.
"""

import math

import fedlite_jax  # noqa: F401  (must precede fedjax)
import fedjax

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlite_jax import transforms as T
from fedlite_jax.algorithms import fedopt
from fedlite_jax.training import algo_lm
from fedlite_jax.training.config import ConfigError

D = 5000
EXAMPLE = {'w': jax.ShapeDtypeStruct((40, 100), jnp.float32),
           'b': jax.ShapeDtypeStruct((1000,), jnp.float32)}


def _tree(seed=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  return {'w': jax.random.normal(k1, (40, 100)),
          'b': jax.random.normal(k2, (1000,))}


@pytest.mark.parametrize('spec,bits', [
    ('intrinsic_projection:256,uniform_quantization:8', 8 * 256 + 64),
    ('intrinsic_projection:256', 32 * 256),
    ('intrinsic_projection:256:4', 32 * 256 + 2),  # + ceil(log2 K) index bits
    ('top_k:300,uniform_quantization:8',
     8 * 300 + 64 + 300 * math.ceil(math.log2(D))),
    ('top_k:300:none', 32 * 300),
    ('uniform_quantization:16', 16 * D + 2 * 64),  # 2 leaves, 64 bits each
    ('terngrad', math.log2(3) * D + 2 * 32),
    ('identity', 32 * D),
    ('count_sketch:3:100', 32 * 3 * 100),
])
def test_stage_message_bits(spec, bits):
  assert T.message_bits(T.parse_chain(spec), EXAMPLE) == pytest.approx(
      bits, rel=1e-12)


def test_stages_equal_hand_built_transforms():
  x = _tree()
  key = jax.random.PRNGKey(3)
  pairs = [
      ('uniform_quantization:8', T.uniform_quantization(8)),
      ('intrinsic_projection:256:2:7,uniform_quantization:4',
       T.chain(T.intrinsic_projection(256, num_subspaces=2, seed=7),
               T.uniform_quantization(4))),
      ('top_k:300,terngrad', T.chain(T.top_k(300), T.terngrad())),
  ]
  for spec, hand in pairs:
    parsed = T.parse_chain(spec)
    got, _ = parsed.encode(x, parsed.init(EXAMPLE), key)
    want, _ = hand.encode(x, hand.init(EXAMPLE), key)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(a, b)


def test_parse_seed_and_generator_defaults():
  x = _tree()
  key = jax.random.PRNGKey(0)
  a = T.parse_chain('intrinsic_projection:64', seed=5)
  b = T.intrinsic_projection(64, seed=5)
  np.testing.assert_array_equal(a.encode(x, a.init(EXAMPLE), key)[0].values,
                                b.encode(x, b.init(EXAMPLE), key)[0].values)
  c = T.parse_chain('uniform_quantization:4', generator='threefry')
  d = T.uniform_quantization(4, generator='threefry')
  for u, v in zip(jax.tree.leaves(c.encode(x, (), key)[0].values),
                  jax.tree.leaves(d.encode(x, (), key)[0].values)):
    np.testing.assert_array_equal(u, v)


@pytest.mark.parametrize('spec,bad', [
    ('', "''"),
    ('quantize:8', "'quantize:8'"),
    ('uniform_quantization:40', "'uniform_quantization:40'"),
    ('uniform_quantization', "'uniform_quantization'"),
    ('top_k:many', "'top_k:many'"),
    ('top_k:10:sometimes', "'top_k:10:sometimes'"),
    ('identity:3', "'identity:3'"),
    ('uniform_quantization:8,,terngrad', "''"),
    ('intrinsic_projection:0', "'intrinsic_projection:0'"),
])
def test_bad_stage_is_one_line_listing_the_forms(spec, bad):
  with pytest.raises(ValueError) as info:
    T.parse_chain(spec)
  message = str(info.value)
  assert '\n' not in message
  assert f'bad compression stage {bad}' in message
  for form in T.STAGE_FORMS:
    assert form in message


def test_read_only_state_detection():
  x = EXAMPLE
  igc = T.chain(T.intrinsic_projection(64), T.uniform_quantization(8))
  state = igc.init(x)
  assert jax.tree.leaves(state)  # really has a state
  assert T.state_is_read_only(igc, x, state)
  assert T.state_is_read_only(T.top_k(10), x, ())
  ef = T.top_k(10, error_feedback=True)
  assert not T.state_is_read_only(ef, x, ef.init(x))
  with pytest.raises(ValueError, match=r'error_feedback') as info:
    T.init_read_only(T.chain(T.uniform_quantization(8), ef), x, 'upload')
  assert '\n' not in str(info.value)


def test_efficient_accepts_read_only_and_refuses_error_feedback():
  params = {'w': jnp.zeros((30,)), 'b': jnp.zeros((10,))}
  grad = lambda p, b, r: p
  hp = fedjax.ShuffleRepeatBatchHParams(batch_size=2)
  igc = T.chain(T.intrinsic_projection(8), T.uniform_quantization(8))
  alg = fedopt.federated_averaging(
      grad, optax.sgd(0.1), optax.sgd(1.0), hp,
      compression=fedopt.Compression(upload=igc))
  alg.init(params)  # No "must be stateless" any more.
  bad = fedopt.federated_averaging(
      grad, optax.sgd(0.1), optax.sgd(1.0), hp,
      compression=fedopt.Compression(upload=T.top_k(
          5, error_feedback=True)))
  with pytest.raises(ValueError, match='upload transform updates its state'):
    bad.init(params)
  sgd_bad = fedopt.federated_averaging(
      grad, optax.sgd(0.1), optax.sgd(1.0), fedopt.batch_hparams(2, 1),
      weighting='uniform',
      compression=fedopt.Compression(upload=T.top_k(5, error_feedback=True)))
  with pytest.raises(ValueError, match='updates its state'):
    sgd_bad.init(params)
  fedopt.federated_averaging(
      grad, optax.sgd(0.1), optax.sgd(1.0), fedopt.batch_hparams(2, 1),
      weighting='uniform', compression=fedopt.Compression(
          upload=T.chain(T.top_k(5), T.uniform_quantization(8)))).init(params)


def _bits(transform):
  return T.message_bits(transform, EXAMPLE)


def test_runner_options_upload_download():
  new = algo_lm.compression_from_options(
      {'upload': 'intrinsic_projection:256,uniform_quantization:8',
       'download': 'uniform_quantization:16'})
  assert _bits(new.upload) == 8 * 256 + 64
  assert _bits(new.download) == 16 * D + 2 * 64
  # The stage strings build the transforms the removed flags built.
  staged = algo_lm.compression_from_options(
      {'upload': 'terngrad:none', 'download': 'uniform_quantization:16'})
  direct = (T.terngrad(clip_std=None), T.uniform_quantization(16))
  x, key = _tree(), jax.random.PRNGKey(1)
  for a, b in zip((staged.upload, staged.download), direct):
    for u, v in zip(jax.tree.leaves(a.encode(x, (), key)[0].values),
                    jax.tree.leaves(b.encode(x, (), key)[0].values)):
      np.testing.assert_array_equal(u, v)
  default = algo_lm.compression_from_options({})
  assert default.upload is None and default.download is None


@pytest.mark.parametrize('options,match', [
    ({'upload': 'terngrad:nan'}, r'--upload=terngrad:nan: bad compression'),
    ({'download': 'uniform_quantization:0'},
     r'--download=uniform_quantization:0: bad compression stage'),
    ({'upload': 'top_k'}, r"--upload=top_k: bad compression stage 'top_k'"),
])
def test_runner_options_errors(options, match):
  with pytest.raises(ConfigError, match=match) as info:
    algo_lm.compression_from_options(options)
  assert '\n' not in str(info.value)


# Runs recorded with the removed flags before they were removed
# (embedded_mnist, 2 rounds of 4 clients, task defaults otherwise): the
# stage strings must give the same final loss and exactly the same bytes.
# name -> (algorithm, stage-string options, removed flags, (loss, upload
# bytes, download bytes) recorded with the removed flags).
RECORDED_WITH_REMOVED_FLAGS = {
    'fedavg_up8_down16_pvt40': (
        'fedavg', {'upload': 'uniform_quantization:8',
                   'download': 'uniform_quantization:16',
                   'pvt_fraction': 0.4},
        '--upload_quantizer=uniform --upload_bits=8 --download_bits=16 '
        '--pvt_fraction=0.4', (2.177410125732422, 3619904.0, 19198624.0)),
    'fedavg_terngrad_noclip': (
        'fedavg', {'upload': 'terngrad:none'},
        '--upload_quantizer=terngrad --noterngrad_clip',
        (1.868877649307251, 1902023.9752903022, 38396224.0)),
    'topk_5000': (
        'topk', {'upload': 'top_k:5000', 'local_steps': 2},
        '--topk_k=5000 --local_steps=2',
        (2.2499585151672363, 265000.0, 278320.0)),
    'igc_static_q8': (
        'igc_static', {'upload': 'uniform_quantization:8',
                       'intrinsic_dim': 1024},
        '--igc_upload_quant_bits=8 --intrinsic_dim=1024',
        (2.278721809387207, 8256.0, 32768.0)),
}


@pytest.mark.parametrize('name', sorted(RECORDED_WITH_REMOVED_FLAGS))
def test_stage_strings_reproduce_the_removed_flags(name, tmp_path):
  from fedlite_jax.training import RunConfig  # pylint: disable=g-import-not-at-top
  from fedlite_jax.training import run  # pylint: disable=g-import-not-at-top
  algorithm, options, _, (loss, up, down) = RECORDED_WITH_REMOVED_FLAGS[name]
  summary = run(RunConfig(
      task='embedded_mnist', algorithm=algorithm, num_rounds=2,
      clients_per_round=4, eval_every=1, checkpoint_every=0, progress=False,
      output_dir=str(tmp_path), options=options))
  comm = summary['communication']
  assert comm['total_upload_bytes'] == up
  assert comm['total_download_bytes'] == down
  # Float noise across CPUs (the q8 row moved by 2e-6 relative on an AMD
  # EPYC without AVX-512); the byte counts above are exact.
  assert summary['final_eval']['loss'] == pytest.approx(loss, rel=1e-5)
