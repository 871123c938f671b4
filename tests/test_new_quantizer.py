"""A quantizer defined here becomes a runner flag with one register_stage call.

Sign-with-scale (signSGD with a per-layer magnitude, cf. Bernstein et al.,
"signSGD", ICML 2018): every value is sent as its sign, every layer with
one float32 scale ``mean |x|``; ``1 * size + 32`` bits per layer.
Independent expectation: that count by hand for the embedded-MNIST CNN
(1,199,882 parameters in 8 layers).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fedlite_jax import transforms as T
from fedlite_jax.training import RunConfig
from fedlite_jax.training import run
from fedlite_jax.transforms import stages


def sign_scale() -> T.CommTransform:
  """Signs plus one float32 scale (mean |x|) per leaf; stateless."""

  def encode(x, state, key):
    del key
    values = jax.tree.map(lambda v: jnp.sign(v) * jnp.mean(jnp.abs(v)), x)
    bits = sum(v.size + 32 for v in jax.tree.leaves(x) if v.size)
    return T.Encoded(values, (), float(bits), 0.0), state

  return T.CommTransform(T.no_state, encode, T.decode_values)


@pytest.fixture
def registry(monkeypatch):
  """Restores the stage table after the test."""
  monkeypatch.setattr(stages, '_STAGES', dict(stages._STAGES))
  monkeypatch.setattr(stages, 'STAGE_FORMS', stages.STAGE_FORMS[:])


def test_runner_upload_bytes_of_a_registered_quantizer(registry, tmp_path):
  T.register_stage('sign_scale', lambda args, seed, generator: sign_scale())
  summary = run(RunConfig(
      task='embedded_mnist', num_clients=12, clients_per_round=3,
      client_batch_size=32, num_rounds=2, eval_every=2, progress=False,
      seed=3, output_dir=str(tmp_path / 'run'),
      options={'upload': 'sign_scale'}))
  comm = summary['communication']
  num_params = 18_816 + 9216 * 128 + 128 + 128 * 10 + 10
  assert comm['num_params'] == num_params == 1_199_882
  per_client_bits = num_params + 8 * 32  # one sign per value, 8 scales
  assert comm['total_upload_bytes'] == 2 * 3 * per_client_bits / 8
  assert comm['total_download_bytes'] == 2 * 3 * 32 * num_params / 8
  assert np.isfinite(summary['final_eval']['loss'])


def test_register_stage_rules(registry):
  T.register_stage('sign_scale', lambda args, seed, generator: sign_scale())
  with pytest.raises(ValueError, match="'sign_scale' is already registered"):
    T.register_stage('sign_scale', lambda args, seed, generator: sign_scale())
  T.register_stage('sign_scale:unused[:more]',
                   lambda args, seed, generator: sign_scale(), replace=True)
  assert stages.STAGE_FORMS.count('sign_scale:unused[:more]') == 1
  assert 'sign_scale' not in stages.STAGE_FORMS
  with pytest.raises(ValueError, match=r'sign_scale takes 1 to 2 argument'):
    T.parse_chain('sign_scale')
  x = jnp.array([[0.5, -2.0], [-1.0, 2.5]])  # mean |x| = 1.5
  t = T.parse_chain('sign_scale:a,uniform_quantization:8')
  message, _ = t.encode(x, t.init(x), jax.random.PRNGKey(0))
  assert message.bits == 8 * 4 + 64  # the last stage's values
  np.testing.assert_array_equal(  # +-1.5 are the 8-bit grid's ends
      t.decode(message, t.init(x))[0], [[1.5, -1.5], [-1.5, 1.5]])
  with pytest.raises(ValueError, match='no name'):
    T.register_stage(':x', lambda args, seed, generator: sign_scale())
