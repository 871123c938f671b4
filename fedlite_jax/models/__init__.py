"""Models split at a cut layer into a client part and a server part.

Each builder returns a :class:`SplitModel`: the whole model as a
``fedjax.Model`` (params ``{'client': ..., 'server': ...}``) plus the split
pair ``client_apply`` / ``server_apply`` used by split learning (FedLite).

  * :func:`create_emnist_cnn`: (F)EMNIST CNN, cut 'flatten', d = 9,216.
  * :func:`create_stackoverflow_lstm`: Stack Overflow NWP LSTM, cut
    'projection', d = 96 per token.
  * :func:`create_stackoverflow_tag_model`: Stack Overflow tag prediction,
    cut 'dense', d = 2,000.

FedLite's quantization layer (grouped PQ forward, equation-5 ``custom_vjp``
backward) is :class:`FedLiteQuantizer` / :func:`vq_with_correction` in
:mod:`fedlite_jax.models.vq_layer`; language models are in
:mod:`fedlite_jax.models.lm`.
"""

from fedlite_jax.models.emnist import create_emnist_cnn
from fedlite_jax.models.split import build_split_model, SplitModel, SplitNet
from fedlite_jax.models.stackoverflow import create_stackoverflow_lstm
from fedlite_jax.models.stackoverflow_tag import create_stackoverflow_tag_model
from fedlite_jax.models.vq_layer import FedLiteQuantizer, vq_with_correction

__all__ = [
    'FedLiteQuantizer', 'SplitModel', 'SplitNet', 'build_split_model',
    'create_emnist_cnn', 'create_stackoverflow_lstm',
    'create_stackoverflow_tag_model', 'vq_with_correction']
