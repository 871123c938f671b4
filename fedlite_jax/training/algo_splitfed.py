"""``--algorithm=splitfed | fedlite``: split learning without (SplitFed) or
with (FedLite) grouped product quantization of the uploaded activations.

Source: Wang et al. (2022), "FedLite", Sections 3-4. One round is one
iteration: each client uses one batch. The server-side model has its own
optimizer (``--split_server_optimizer``, default: the client's).
"""

from __future__ import annotations

import fedjax

from fedlite_jax.algorithms import split_accounting
from fedlite_jax.algorithms.split_clients import resolve_client_execution
from fedlite_jax.algorithms import splitfed
from fedlite_jax.training import compression_options as common
from fedlite_jax.training import optimizers
from fedlite_jax.training import spec
from fedlite_jax.transforms import pq

ConfigError = spec.ConfigError
Option = spec.Option
_opt = spec.option_value

#: Subvector size for ``--num_subvectors=0`` (FEMNIST: q = 9,216 / 8 = 1,152).
AUTO_SUBVECTOR_SIZE = 8

NUM_SUBVECTORS = Option(
    'num_subvectors', 0, 'FedLite q: subvectors per activation vector (divides '
    'the cut size d); 0 = d / 8 when 8 divides d, else d.', lower_bound=0)
NUM_GROUPS = Option(
    'num_groups', 1, 'FedLite R: groups of subvectors sharing one codebook '
    '(divides q); q = vanilla product quantization.', lower_bound=1)
NUM_CENTROIDS = Option(
    'num_centroids', 2, 'FedLite L: k-means centroids per group (L <= N q / '
    'R, N = activation vectors per client).', lower_bound=1)
CORRECTION_LAMBDA = Option(
    'correction_lambda', 0.0, 'FedLite lambda >= 0 of the gradient correction '
    '(eq. 5; see --fedlite_lambda_scaling); 0 = straight-through.',
    lower_bound=0.0)
LAMBDA_SCALING = Option(
    'fedlite_lambda_scaling', 'example', 'example: lambda (z - z~) per '
    'example, averaged like the loss (App. B eq. 36); batch: added to the '
    'batch-mean loss gradient (= example with lambda x B).',
    choices=('example', 'batch'))
KMEANS_ITERS = Option(
    'fedlite_kmeans_iters', pq.DEFAULT_NUM_ITERS, 'FedLite: Lloyd iterations '
    'per k-means (seeded stratified init).', lower_bound=0)
EMPTY_CLUSTER = Option(
    'fedlite_empty_cluster', 'farthest', 'FedLite k-means empty clusters: '
    'farthest (move to the worst-fit point) or keep.',
    choices=('farthest', 'keep'))
PHI = Option(
    'fedlite_phi', pq.DEFAULT_PHI, "Bits per float in the paper's compression "
    "ratios (paper: 64); the ledger counts 32-bit floats.",
    lower_bound=1.0, affects_result=False)
SERVER_OPTIMIZER = Option(
    'split_server_optimizer', 'same', 'Optimizer of the server-side model: '
    'same (= --client_optimizer), sgd, adam, adagrad.',
    choices=('same', 'sgd', 'adam', 'adagrad'))
SERVER_LR = Option(
    'split_server_lr', 0.0, 'Learning rate eta_s of the server-side model; 0 = '
    '--client_lr.', lower_bound=0.0)
LABEL_BITS = Option(
    'split_label_bits', splitfed.AUTO_LABEL_BITS, 'Bits per uploaded label '
    'entry: -1 = ceil(log2(outputs)) (1 for multi-hot), 0 = labels not sent '
    '(vertical FL).', lower_bound=-1, affects_result=False)
CLIENT_WEIGHTING = Option(
    'split_client_weighting', 'uniform', 'Client weights p_i of the server '
    'objective and gradient average: uniform (mini-batch SGD over all '
    'examples) or examples (the client\'s example count).',
    choices=('uniform', 'examples'))
CLIENT_EXECUTION = Option(
    'split_client_execution', 'auto', "Clients' forward/backward in the "
    "compiled iteration: vmap, unroll, or auto (unroll on CPU).",
    choices=('auto', 'vmap', 'unroll'), affects_result=False)

_OWN_SERVER = ('the server-side model has --split_server_optimizer and '
               '--split_server_lr')
_OWN_CLIENTS = ('split learning runs its clients itself '
                '(--split_client_execution)')

#: FedAvg-style flags these algorithms do not read, with the reason.
IGNORED_FIELDS = {
    'server_optimizer': _OWN_SERVER, 'server_lr': _OWN_SERVER,
    'server_beta1': _OWN_SERVER, 'server_beta2': _OWN_SERVER,
    'server_eps': _OWN_SERVER,
    'client_epochs': 'each client uses one batch per round',
    'round_engine': _OWN_CLIENTS, 'segment_steps': _OWN_CLIENTS,
}

SPLIT_OPTIONS = (SERVER_OPTIMIZER, SERVER_LR, LABEL_BITS, CLIENT_WEIGHTING,
                 CLIENT_EXECUTION, PHI, common.NONFINITE_UPDATES)
FEDLITE_OPTIONS = (NUM_SUBVECTORS, NUM_GROUPS, NUM_CENTROIDS,
                   CORRECTION_LAMBDA, LAMBDA_SCALING, KMEANS_ITERS,
                   EMPTY_CLUSTER)


def auto_num_subvectors(cut_size: int) -> int:
  """q for ``--num_subvectors=0``: ``d / 8`` if 8 divides ``d``, else ``d``."""
  if cut_size % AUTO_SUBVECTOR_SIZE == 0:
    return cut_size // AUTO_SUBVECTOR_SIZE
  return cut_size


def clients_vmapped(config, engine_name: str) -> bool:
  """Whether the clients run vmapped: ``--split_client_execution`` resolved
  (the round engine ``engine_name`` does not run them)."""
  del engine_name
  return resolve_client_execution(_opt(config.options, CLIENT_EXECUTION)) \
      == 'vmap'


def _common_kwargs(ctx: spec.BuildContext) -> dict:
  config, opts = ctx.config, ctx.config.options
  server_name = _opt(opts, SERVER_OPTIMIZER)
  if server_name == 'same':
    server_name = config.client_optimizer
  server_lr = _opt(opts, SERVER_LR) or config.client_lr
  return dict(
      split_model=ctx.split_model,
      client_optimizer=optimizers.client_optimizer(config),
      server_optimizer=optimizers.make_optimizer(server_name, server_lr),
      batch_size=config.client_batch_size,
      phi=_opt(opts, PHI),
      label_bits=_opt(opts, LABEL_BITS),
      client_weighting=_opt(opts, CLIENT_WEIGHTING),
      client_execution=_opt(opts, CLIENT_EXECUTION),
      lanes_per_device=config.lanes_per_device,
      nonfinite=_opt(opts, common.NONFINITE_UPDATES))


def build_splitfed(ctx: spec.BuildContext) -> fedjax.FederatedAlgorithm:
  """``--algorithm=splitfed`` (ConfigError for invalid settings)."""
  try:
    return splitfed.splitfed(**_common_kwargs(ctx))
  except ValueError as e:
    raise ConfigError(f'splitfed: {e}') from None


def quantizer_from_options(ctx: spec.BuildContext
                           ) -> splitfed.QuantizerConfig:
  """The :class:`splitfed.QuantizerConfig` of a run.

  Raises:
    ConfigError: q not dividing d, R not dividing q, L too large, ...
  """
  opts = ctx.config.options
  d = ctx.split_model.cut_size
  q = _opt(opts, NUM_SUBVECTORS) or auto_num_subvectors(d)
  if d % q:
    raise ConfigError(f'--num_subvectors={q}: must divide the cut size d={d} '
                      f'of task {ctx.config.task!r}.')
  try:
    quantizer = splitfed.QuantizerConfig(
        num_subvectors=q,
        num_groups=_opt(opts, NUM_GROUPS),
        num_centroids=_opt(opts, NUM_CENTROIDS),
        correction_lambda=float(_opt(opts, CORRECTION_LAMBDA)),
        lambda_scaling=_opt(opts, LAMBDA_SCALING),
        kmeans_iters=_opt(opts, KMEANS_ITERS),
        empty_cluster=_opt(opts, EMPTY_CLUSTER))
  except ValueError as e:
    raise ConfigError(f'fedlite: {e}') from None
  # A group has at most B L q / R subvectors (L tokens per example).
  batch = ctx.config.client_batch_size
  length = getattr(getattr(ctx.info, 'dataset', None), 'sequence_length',
                   None) or 1
  points = batch * length * (q // quantizer.num_groups)
  if quantizer.num_centroids > points:
    raise ConfigError(
        f'--num_centroids={quantizer.num_centroids}: must be at most the '
        f'subvectors per group, --client_batch_size x vectors per example x '
        f'--num_subvectors / --num_groups = {batch} x {length} x {q} / '
        f'{quantizer.num_groups} = {points}.')
  return quantizer


def build_fedlite(ctx: spec.BuildContext) -> fedjax.FederatedAlgorithm:
  """``--algorithm=fedlite`` (ConfigError for invalid settings)."""
  quantizer = quantizer_from_options(ctx)
  try:
    return splitfed.fedlite(quantizer=quantizer, **_common_kwargs(ctx))
  except ValueError as e:
    raise ConfigError(f'fedlite: {e}') from None


def _spec(**kwargs) -> spec.AlgorithmSpec:
  # One process only: the split program reads every client's batch itself.
  kwargs['communication_keys'] = split_accounting.BIT_KEYS
  kwargs['communication_summary'] = split_accounting.communication_summary
  return spec.AlgorithmSpec(multi_process=False,
                            ignored_fields=IGNORED_FIELDS,
                            client_vmap=clients_vmapped, **kwargs)


SPECS = (
    _spec(
        name='splitfed',
        description='SplitFed (Thapa et al. 2020; FedLite Sec. 3): split '
        'learning, one batch per client per round, server steps on all '
        'activations, client gradients averaged.',
        build=build_splitfed, options=SPLIT_OPTIONS),
    _spec(
        name='fedlite',
        description='FedLite (Wang et al. 2022): SplitFed + grouped product '
        'quantization of the uploaded activations + gradient correction.',
        build=build_fedlite, options=SPLIT_OPTIONS + FEDLITE_OPTIONS),
)
"""The algorithms of this module, collected by the registry."""
