"""Tasks: a federated dataset, its split-ready model, and default settings.

The defaults are each task's reference settings (FedJAX's EMNIST FedAvg;
Reddi et al. 2021 FedAdam for StackOverflow NWP; FedLite App. C.2 for
StackOverflow tags); their sources are in ``docs/notes/training.md``.
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
  """A runnable task: ``--task`` name, headline test metric ('accuracy' or
  'perplexity'), RunConfig defaults, ``load_data(config) -> (train, test,
  LoadedInfo)``, ``build_model(config, info) -> SplitModel``; ``multilabel``:
  the eval loss is the sum of the per-class sigmoid cross-entropies."""
  name: str
  metric: str
  defaults: dict[str, Any]
  load_data: Callable[[RunConfig], Any]
  build_model: Callable[[RunConfig, Any], models.SplitModel]
  multilabel: bool = False

  def chance_loss(self, info: 'LoadedInfo') -> float:
    """The eval loss (nats) of an uninformed model (evaluation.chance_loss)."""
    return evaluation.chance_loss(info.dataset.num_classes, self.multilabel)


@dataclasses.dataclass(frozen=True)
class LoadedInfo:
  """DatasetInfo plus a one-line description for logs and summaries."""
  dataset: datasets.DatasetInfo
  description: str

  @property
  def synthetic_partition(self) -> bool:
    """True if the clients come from a synthetic partition (not real users)."""
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


def _compute_dtype(config: RunConfig) -> Any:
  """The model's computation dtype (None: float32, the default)."""
  return None if config.compute_dtype == 'float32' else config.compute_dtype


def _cnn(config: RunConfig, info: LoadedInfo) -> models.SplitModel:
  conv = config.conv_implementation
  return models.create_emnist_cnn(
      num_classes=info.dataset.num_classes,
      conv_implementation='lax' if conv == 'auto' else conv,
      compute_dtype=_compute_dtype(config))


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
  """The task called ``name`` (ConfigError listing the allowed ones)."""
  try:
    return TASKS[name]
  except KeyError:
    raise ConfigError(f'--task={name!r}: allowed values are '
                      f'{", ".join(TASKS)}.') from None
