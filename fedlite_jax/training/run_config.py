"""The runner's settings: :class:`RunConfig`, one field per flag of
``experiments/run_experiment.py``.

Each field's metadata holds its flag's help, type, choices and bound;
``None`` fields take the task's defaults. :mod:`~fedlite_jax.training.config`
resolves and validates a RunConfig and re-exports every name here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from fedlite_jax import rounds
from fedlite_jax.models import layers as models_layers
from fedlite_jax.models import lm
from fedlite_jax.training import dp_options
from fedlite_jax.training import registry

CLIENT_OPTIMIZERS = ('sgd', 'adam', 'adagrad')
SERVER_OPTIMIZERS = ('sgd', 'adam', 'adagrad', 'yogi')
TOKENIZERS = ('word', 'sentencepiece')
ROUND_ENGINES = rounds.ENGINE_NAMES
CONV_IMPLEMENTATIONS = ('auto',) + models_layers.CONV_IMPLEMENTATIONS
COMPUTE_DTYPES = ('float32', 'bfloat16')
#: ``--plot_format``: the formats of ``plots.FORMATS``.
PLOT_FORMATS = ('png', 'pdf', 'svg')


def _field(default: Any, help_text: str, *, kind: type | None = None,
           choices: Sequence[str] | None = None,
           lower_bound: float | None = None) -> Any:
  """A RunConfig field with its flag's help, type (default: type(default)),
  string choices and inclusive lower bound."""
  return dataclasses.field(default=default, metadata={
      'help': help_text, 'kind': kind or type(default), 'choices': choices,
      'lower_bound': lower_bound})


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """All settings of one federated run; each field is a runner flag.

  Algorithm options (``--upload``, ``--dp_clip``, ... of
  ``registry.all_options()``) are keywords too, kept in ``options``:
  ``RunConfig(upload='uniform_quantization:8')`` equals
  ``RunConfig(options={'upload': 'uniform_quantization:8'})``.

  Raises:
    TypeError: a keyword that is neither a field nor an algorithm option.
  """
  task: str = _field('embedded_mnist', 'Federated task.')
  algorithm: str = _field(registry.DEFAULT_ALGORITHM, 'Federated algorithm.')
  num_rounds: int | None = _field(None, 'Training rounds.', kind=int,
                                  lower_bound=1)
  clients_per_round: int | None = _field(None, 'Cohort size.', kind=int,
                                         lower_bound=1)
  client_batch_size: int | None = _field(
      None, 'Local batch size (examples per local step).', kind=int,
      lower_bound=1)
  client_epochs: int = _field(1, 'Local epochs over the client data.',
                              lower_bound=1)
  max_examples_per_client: int | None = _field(
      None, "Use at most a client's first N examples per round (as TFF "
      'take()); 0 = all.', kind=int, lower_bound=0)
  client_optimizer: str | None = _field(None, 'Client optimizer.', kind=str,
                                        choices=CLIENT_OPTIMIZERS)
  client_lr: float | None = _field(None, 'Client learning rate.', kind=float)
  client_clip_norm: float | None = _field(
      None, 'Client gradient global-norm clip (0 = off).', kind=float)
  server_optimizer: str | None = _field(
      None, 'Server optimizer (sgd = FedAvg, adam = FedAdam).', kind=str,
      choices=SERVER_OPTIMIZERS)
  server_lr: float | None = _field(None, 'Server learning rate.', kind=float)
  server_beta1: float = _field(0.9, 'Server Adam/Yogi beta1.')
  server_beta2: float = _field(0.999, 'Server Adam/Yogi beta2.')
  server_eps: float | None = _field(None, 'Server optimizer epsilon.',
                                    kind=float)
  eval_every: int | None = _field(None, 'Evaluate every N rounds.', kind=int,
                                  lower_bound=1)
  eval_batch_size: int = _field(256, 'Evaluation batch size.', lower_bound=1)
  eval_num_clients: int | None = _field(
      None, 'Test clients to evaluate on (0 = all).', kind=int, lower_bound=0)
  seed: int = _field(0, 'Seed in [0, 2**32 - 1]; all keys (sampling, init, '
                     'shuffles) derive from seed, round, client.')
  data_dir: str | None = _field(
      None, 'Data directory, the only one searched when given (else '
      '$FEDLITE_DATA_DIR, ~/.cache/fedjax, ~/.tff).', kind=str)
  output_dir: str | None = _field(
      None, 'Output directory (default runs/<task>_<algorithm>[_up-<stages>]'
      '[_down-<stages>][_dp-eps<e>]_seed<seed>_<hash of the result flags>).',
      kind=str)
  checkpoint_every: int = _field(
      50, 'Checkpoint every N rounds (0 = only at the end).', lower_bound=0)
  resume: bool = _field(True, 'Resume from the latest checkpoint.')
  overwrite: bool = _field(False, 'Replace results of another run.')
  allow_download: bool = _field(
      False, 'Let FedJAX download missing data (needs network).')
  round_engine: str = _field(
      'auto', 'Client execution: vmap (one program; GPU/TPU), loop (one '
      'jitted step per batch; CPU), auto (by platform).', choices=ROUND_ENGINES)
  lanes_per_device: Any = _field(
      'auto', 'vmap engine and split learning: clients run side by side per '
      'device, each lane streaming its clients (peak memory follows it); '
      'auto = from model and device memory, at most the cohort.', kind=str)
  segment_steps: int = _field(
      4, 'vmap engine: local steps per compiled segment (one call).',
      lower_bound=1)
  conv_implementation: str = _field(
      'auto', 'CNN convolutions: lax, im2col (a matmul: no grouped '
      'convolution when vmapped over clients), auto (im2col with the vmap '
      'engine or vmapped split learning). Equal to float rounding.',
      choices=CONV_IMPLEMENTATIONS)
  compute_dtype: str = _field(
      'float32', 'Model computation dtype (flax dtype); parameters, '
      'optimizer states, deltas and sums stay float32. bfloat16 is for '
      'GPU/TPU.', choices=COMPUTE_DTYPES)
  client_cache_mb: int = _field(
      1024, 'MiB of decoded client data kept across rounds (LRU; 0 = off). '
      'No effect on results.', lower_bound=0)
  prefetch_clients: bool = _field(
      True, "Load the next round's clients in a background thread. No "
      'effect on results.')
  compilation_cache_dir: str = _field(
      'auto', "JAX's persistent compilation cache: a later run of the same "
      'programs (another seed, a resumed run) loads them instead of '
      'compiling. auto = $JAX_COMPILATION_CACHE_DIR if set, else '
      '$XDG_CACHE_HOME (~/.cache)/fedlite_jax/xla; off; or a directory. No '
      'effect on results.', kind=str)
  num_devices: int | None = _field(
      None, "Local devices to split each round's clients over (default: "
      'all). Results equal up to float tolerance.', kind=int)
  coordinator_address: str | None = _field(
      None, 'Multi-host runs: host:port of process 0 (jax.distributed).',
      kind=str)
  num_processes: int = _field(1, 'Multi-host runs: number of processes.',
                              lower_bound=1)
  process_id: int = _field(0, "Multi-host runs: this process's index.",
                           lower_bound=0)
  distributed_timeout: int = _field(
      60, 'Multi-host runs: seconds to wait for all processes.', lower_bound=1)
  progress: bool = _field(True, 'Show a progress bar.')
  plot_format: str = _field('png', 'File format of the curves plot '
                            '(curves.<format>).', choices=PLOT_FORMATS)
  # Task-specific (see TASK_FIELDS).
  sequence_length: int = _field(20, 'Next-word prediction sequence length.',
                                lower_bound=1)
  vocab_size: int = _field(10000, 'Word vocabulary size (next-word '
                           'prediction).', lower_bound=1)
  num_clients: int = _field(50, 'embedded_mnist: number of synthetic '
                            'clients.', lower_bound=1)
  dirichlet_alpha: float = _field(
      0.5, 'embedded_mnist: Dirichlet label-skew concentration.')
  tokenizer: str = _field(
      'word', 'Text tasks: word vocabulary, or a SentencePiece model trained '
      'on the training split (Ro et al. 2022; with --sequence_length=30).',
      choices=TOKENIZERS)
  sp_vocab_size: int = _field(
      4096, 'SentencePiece ids incl. PAD/BOS/EOS/UNK (paper: 4K).',
      lower_bound=5)
  model: str | None = _field(
      None, 'Language model preset (Ro et al. 2022 Table 1, plus tiny CPU '
      'presets); default: the task model (lstm_small with sentencepiece).',
      kind=str, choices=tuple(lm.PRESETS))
  lm_loss_reduction: str = _field(
      'sequence_sum', 'LM presets: per-sequence sum (FedJAX) or mean of '
      'token cross-entropies.', choices=tuple(lm.LOSS_REDUCTIONS))
  init_checkpoint: str | None = _field(
      None, 'Start from the parameters of experiments/pretrain_centralized.py '
      'or a runner checkpoint (checkpoints/<round>).', kind=str)
  # Algorithm-specific options (registry.Option), by name.
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  # Flags that do not change the result (not in the checkpoint fingerprint).
  NON_RESULT_FIELDS = (
      'num_rounds', 'eval_every', 'eval_batch_size', 'eval_num_clients',
      'data_dir', 'output_dir', 'checkpoint_every', 'resume', 'overwrite',
      'allow_download', 'round_engine', 'lanes_per_device', 'segment_steps',
      'conv_implementation', 'client_cache_mb', 'compilation_cache_dir',
      'prefetch_clients', 'num_devices',
      'coordinator_address', 'num_processes', 'process_id',
      'distributed_timeout', 'progress', 'plot_format')

  # Result fields added later, left out at their default so that runs
  # written before them keep their identity.
  OMITTED_AT_DEFAULT = {'compute_dtype': 'float32'}

  def fingerprint(self) -> dict[str, Any]:
    """The result-determining settings (stored in checkpoints, checked)."""
    known = registry.all_options()
    out = {k: v for k, v in dataclasses.asdict(self).items()
           if k not in self.NON_RESULT_FIELDS and k != 'options' and
           self.OMITTED_AT_DEFAULT.get(k, object()) != v}
    out['options'] = {k: v for k, v in sorted(self.options.items())
                      if (k not in known or known[k].affects_result) and not
                      (k in dp_options.NAMES and v == known[k].default)}
    return out


_dataclass_init = RunConfig.__init__


def _init(self, *args, **kwargs) -> None:
  """RunConfig's ``__init__``, algorithm options given as keywords moved
  into ``options`` (TypeError naming an unknown keyword)."""
  extra = [k for k in kwargs if k not in RunConfig.__dataclass_fields__]
  if extra:
    known = registry.all_options()
    for name in extra:
      if name not in known:
        raise TypeError(
            f'RunConfig() got an unknown keyword {name!r}: not a runner flag '
            'nor an algorithm option (registry.all_options()); pass options '
            "as keywords, e.g. upload='uniform_quantization:8', or as "
            "options={...}.")
    kwargs['options'] = {**kwargs.get('options', {}),
                         **{k: kwargs.pop(k) for k in extra}}
  _dataclass_init(self, *args, **kwargs)


RunConfig.__init__ = _init
