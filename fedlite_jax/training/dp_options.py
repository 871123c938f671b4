"""The ``--dp_*`` flags of the FedAvg family and ``igc_static``: central
DP-FedAvg and its accounting (docs/runner.md, "Differential privacy").

DP-FedAvg (McMahan et al. 2018, Alg. 1) as :class:`fedopt.DP`
(:class:`fedlite_jax.privacy.DPSettings`): each
client's decoded upload (the delta as the server sums it, after the
``--upload`` chain's decode) is clipped to L2 norm C, so one client changes
the sum by at most C whatever the chain (``privacy.clip_sensitivity``,
``'decoded'``); weights are uniform, Gaussian noise goes on the sum and the
mean has the fixed denominator ``--clients_per_round``. Under
``igc_static`` the same happens to the d intrinsic coordinates (noise on the
d-dimensional sum, then the map back to D). Adaptive clipping:
Andrew et al. 2021, Alg. 1, with their recommended ``eta_C = 0.2`` and
count noise ``sigma_b = cohort / 20`` (:data:`CLIP_LEARNING_RATE`,
:data:`COUNT_NOISE_FRACTION`). Accounting: ``fedlite_jax.privacy`` (RDP or
PLD of Google's ``dp_accounting``, ``--dp_accountant``) at ``q = cohort /
population``. :func:`resolve` runs once per resolved config: the builder,
the privacy hook and ``validate`` share its :class:`Privacy`.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Iterable, NamedTuple, Optional
import weakref

from fedlite_jax import privacy
from fedlite_jax.privacy import ddp_accounting
from fedlite_jax.algorithms import fedopt
from fedlite_jax.training import compression_options
from fedlite_jax.training import spec

ConfigError = spec.ConfigError
Option = spec.Option
_opt = spec.option_value

#: Andrew et al. 2021 (Sec. 4): ``eta_C = 0.2`` and ``sigma_b = m / 20``.
CLIP_LEARNING_RATE = 0.2
COUNT_NOISE_FRACTION = 1 / 20

DP_CLIP = Option(
    'dp_clip', 0.0, 'DP-FedAvg (McMahan et al. 2018): L2 clip norm C > 0 of '
    "each client's decoded update (units of the parameters); with "
    '--dp_adaptive_quantile the first round\'s C. 0 = unset = no DP.')
DP_NOISE_MULTIPLIER = Option(
    'dp_noise_multiplier', -1.0, 'DP-FedAvg noise multiplier z >= 0 of the '
    'Gaussian mechanism: noise std z*C on the sum of M clipped updates, '
    'i.e. z*C/M on the mean (M = --dp_noise_cohort_size, default '
    '--clients_per_round); with --dp_adaptive_quantile the update sum gets '
    'z_Delta > z and the clipped-count noise the rest. -1 = unset (then '
    '--dp_target_epsilon).')
DP_TARGET_EPSILON = Option(
    'dp_target_epsilon', 0.0, 'Epsilon > 0 at --dp_delta after --num_rounds '
    'rounds; z is calibrated to it (dp_accounting, --dp_accountant). 0 = '
    'unset.')
DP_DELTA = Option(
    'dp_delta', 1e-6, 'delta in (0, 1) of the reported (epsilon, delta); '
    'keep it below 1/population (1e-6: populations up to ~10^6 clients).')
DP_ADAPTIVE_QUANTILE = Option(
    'dp_adaptive_quantile', -1.0, 'Adaptive clipping (Andrew et al. 2021): '
    'target quantile gamma in [0, 1] of the update norms; C moves by '
    'exp(-0.2 (b - gamma)) per round, b the noised unclipped fraction (count '
    'noise std cohort/20, part of z). -1 = fixed C.')
DP_NOISE_COHORT_SIZE = Option(
    'dp_noise_cohort_size', 0, 'Production cohort M the noise and accounting '
    'are for (pfl-research): noise std z*C*clients_per_round/M on the sum, q '
    '= max(M, clients_per_round)/population. 0 = --clients_per_round.')
DP_POPULATION = Option(
    'dp_population', 0, 'Population N of the accounting, q = cohort/N. 0 = '
    "the task's training clients.")

DP_ACCOUNTANT = Option(
    'dp_accountant', 'rdp', "dp_accounting's accountant of epsilon and of "
    "--dp_target_epsilon's calibration: rdp (Renyi DP) or pld (privacy loss "
    'distributions; tighter, slower).', choices=privacy.ACCOUNTANTS)

DP_MECHANISM = Option(
    'dp_mechanism', 'gaussian', 'gaussian = central DP (a trusted server '
    'adds Gaussian noise to the sum); ddgauss (Kairouz et al. 2021) or '
    'skellam (Agarwal et al. 2021) = distributed DP under secure aggregation: '
    'each client rotates, scales, rounds and noises its clipped update and '
    'uploads --dp_bits-bit integers; the server sees only their sum mod '
    '2^B. --dp_noise_multiplier z gives the sum a noise std z*C.',
    choices=('gaussian',) + privacy.MECHANISMS)
DP_BITS = Option(
    'dp_bits', 16, 'Distributed DP: bits B per coordinate of the secure sum '
    '(the upload is B * padded dim bits per client), in [2, 32].',
    lower_bound=2, upper_bound=32)
DP_ROUNDING_BETA = Option(
    'dp_rounding_beta', math.exp(-0.5), "Distributed DP: conditional "
    "randomized rounding's beta in [0, 1) (0 = unconditional; the papers' "
    'exp(-0.5)).', lower_bound=0.0)
DP_K_STDDEVS = Option(
    'dp_k_stddevs', 0.0, 'Distributed DP: the scale 1/gamma fits this many '
    'standard deviations of the noisy sum into 2^B (Kairouz et al. 2021, '
    "Sec. 4); 0 = the papers' code: 4 for ddgauss, 3 for skellam.",
    lower_bound=0.0)

DP_OPTIONS = (DP_CLIP, DP_NOISE_MULTIPLIER, DP_TARGET_EPSILON, DP_DELTA,
              DP_ADAPTIVE_QUANTILE, DP_NOISE_COHORT_SIZE, DP_POPULATION,
              DP_ACCOUNTANT, DP_MECHANISM, DP_BITS, DP_ROUNDING_BETA,
              DP_K_STDDEVS)
#: Metrics logged from the clients' data without noise: epsilon does not
#: cover them (summary.json's ``privacy.not_covered_by_epsilon``).
NOT_COVERED = ('train/loss', 'train/accuracy', 'train/delta_norm_mean',
               'train/delta_norm_max', 'privacy/clipped_fraction')

#: Only with --dp_mechanism=ddgauss|skellam.
DISTRIBUTED_OPTIONS = (DP_BITS, DP_ROUNDING_BETA, DP_K_STDDEVS)
#: Left out of checkpoint fingerprints at their defaults (runs without DP
#: keep their identity).
NAMES = frozenset(o.name for o in DP_OPTIONS)


def enabled(config: Any) -> bool:
  """Whether ``config`` (resolved) runs DP-FedAvg (``--dp_clip`` set)."""
  return DP_CLIP.name in config.options and _opt(config.options, DP_CLIP) != 0


def _cohort(config: Any) -> int:
  return int(_opt(config.options, DP_NOISE_COHORT_SIZE)) or \
      config.clients_per_round


def _accounting_cohort(config: Any) -> int:
  """``max(m, M)``: the sampling probability's cohort (as pfl-research). A
  noise cohort M below the trained cohort m gives the trained sum more
  noise than z*C (``z*C*m/M``), so accounting at ``m/N`` with z is sound."""
  return max(_cohort(config), config.clients_per_round)


def check(config: Any, explicit: Iterable[str]) -> None:
  """ConfigError (one line naming the flag and the allowed range) for a bad
  ``--dp_*`` value of resolved ``config``; ``explicit``: the names set."""
  opts = config.options
  given = [o.name for o in DP_OPTIONS if o.name in set(explicit)]
  if DP_CLIP.name not in opts or not given:
    return
  if DP_CLIP.name not in given:
    raise ConfigError(f'--{given[0]} needs --dp_clip (C > 0; no DP without '
                      'it); set it or remove the flag.')
  o = {name: _opt(opts, option) for name, option in
       zip(('c', 'z', 'eps', 'delta', 'gamma', 'm', 'n'), DP_OPTIONS)}
  z_given = DP_NOISE_MULTIPLIER.name in given
  eps_given = DP_TARGET_EPSILON.name in given
  for bad, text in (
      (not o['c'] > 0, f'--dp_clip={o["c"]}: must be > 0 (L2 clip norm C).'),
      (z_given and not o['z'] >= 0,
       f'--dp_noise_multiplier={o["z"]}: must be >= 0.'),
      (eps_given and not o['eps'] > 0,
       f'--dp_target_epsilon={o["eps"]}: must be > 0.'),
      (z_given and eps_given, '--dp_noise_multiplier and --dp_target_epsilon '
       'exclude each other; give one.'),
      (not (z_given or eps_given), '--dp_clip needs --dp_noise_multiplier (z '
       '>= 0) or --dp_target_epsilon (> 0).'),
      (not 0 < o['delta'] < 1, f'--dp_delta={o["delta"]}: must be in (0, 1).'),
      (DP_ADAPTIVE_QUANTILE.name in given and not 0 <= o['gamma'] <= 1,
       f'--dp_adaptive_quantile={o["gamma"]}: must be in [0, 1].'),
      (DP_NOISE_COHORT_SIZE.name in given and not o['m'] >= 1,
       f'--dp_noise_cohort_size={o["m"]}: must be >= 1.'),
      (DP_POPULATION.name in given and
       not o['n'] >= _accounting_cohort(config),
       f'--dp_population={o["n"]}: must be >= the cohort of the accounting '
       f'({_accounting_cohort(config)}).'),
      (_opt(opts, compression_options.PVT_FRACTION) < 1 and
       _opt(opts, DP_MECHANISM) == 'gaussian',
       '--pvt_fraction < 1 with --dp_clip: central DP-FedAvg needs one fixed '
       'denominator for every variable; remove one.'),
      (_opt(opts, compression_options.IGC_PROJECT_ON_SERVER),
       '--igc_project_on_server with --dp_clip: DP clips each client in the '
       'subspace; remove one.')):
    if bad:
      raise ConfigError(text)
  _check_distributed(config, set(given))
  if z_given:
    _settings(config, o['z'])


def mechanism(config: Any) -> str:
  """``--dp_mechanism`` of resolved ``config`` (``'gaussian'`` without it)."""
  return str(_opt(config.options, DP_MECHANISM)) if enabled(config) else \
      'gaussian'


def _k_stddevs(config: Any) -> float:
  return float(_opt(config.options, DP_K_STDDEVS)) or \
      ddp_accounting.DEFAULT_K[mechanism(config)]


def _check_distributed(config: Any, given: set[str]) -> None:
  """One-line ConfigErrors for the distributed mechanisms' flags."""
  opts, mech = config.options, mechanism(config)
  if mech == 'gaussian':
    extra = [o.name for o in DISTRIBUTED_OPTIONS if o.name in given]
    if extra:
      raise ConfigError(f'--{extra[0]} applies to --dp_mechanism=ddgauss or '
                        'skellam only; got --dp_mechanism=gaussian.')
    return
  bits, beta = int(_opt(opts, DP_BITS)), float(_opt(opts, DP_ROUNDING_BETA))
  upload = str(_opt(opts, compression_options.UPLOAD) if
               compression_options.UPLOAD.name in opts else '').strip()
  with_mech = f'with --dp_mechanism={mech}'
  for bad, text in (
      (not beta < 1, f'--dp_rounding_beta={beta}: must be in [0, 1).'),
      (bool(upload), f'--upload={upload} {with_mech}: secure aggregation sums '
       f"the clients' own {bits}-bit integers, which replace upload "
       'quantizers, and top-k is not linear; remove --upload.'),
      (DP_ADAPTIVE_QUANTILE.name in given, f'--dp_adaptive_quantile '
       f'{with_mech}: adaptive clipping under secure aggregation is not '
       'supported (its clipped count would need its own secure sum); use a '
       'fixed --dp_clip.'),
      (DP_NOISE_COHORT_SIZE.name in given, f'--dp_noise_cohort_size '
       f"{with_mech}: the noise is the round's own clients' shares; remove "
       'it.'),
      (DP_ACCOUNTANT.name in given and _opt(opts, DP_ACCOUNTANT) != 'rdp',
       f'--dp_accountant='
       f'{_opt(opts, DP_ACCOUNTANT)} {with_mech}: the distributed mechanisms '
       "are accounted with their RDP bounds; use --dp_accountant=rdp."),
      (_opt(opts, compression_options.NONFINITE_UPDATES) == 'skip',
       f'--nonfinite_updates=skip {with_mech}: a skipped client\'s noise '
       'share would be missing from the secure sum; use raise.')):
    if bad:
      raise ConfigError(text)
  n, k = config.clients_per_round, _k_stddevs(config)
  need = ddp_accounting.min_bits(n, k)
  if bits < need:
    raise ConfigError(
        f'--dp_bits={bits} is too small for {n} clients per round at k={k:g} '
        f'standard deviations: need --dp_bits >= {need}.')


class Privacy(NamedTuple):
  """A run's DP-FedAvg settings and accounting.

  Attributes:
    dp: the algorithm's settings (``noise_multiplier``: z, calibrated when
      ``target_epsilon`` is set).
    delta: ``--dp_delta``.
    sampling_probability: ``q = cohort / population`` (Poisson sampling).
    population: N.
    target_epsilon: ``--dp_target_epsilon``, or None.
    accountant: ``'rdp'`` or ``'pld'`` (``--dp_accountant``).
    secure: the distributed mechanism's settings, or None (central DP);
      ``dp`` then holds C, z (the secure sum's noise std is ``z * C``) and
      the denominator.
  """
  dp: fedopt.DP
  delta: float
  sampling_probability: float
  population: int
  target_epsilon: Optional[float]
  accountant: str = 'rdp'
  secure: Optional[privacy.DistributedDP] = None

  @property
  def algorithm_dp(self) -> Any:
    """What the algorithm takes as ``dp``: ``secure`` or ``dp``."""
    return self.dp if self.secure is None else self.secure

  def epsilon(self, rounds: int) -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds (``inf`` for z = 0)."""
    dp = self.dp
    if dp.noise_multiplier == 0:
      return math.inf
    if self.secure is not None:
      return privacy.secure_epsilon(
          self.secure, self.sampling_probability, rounds, self.delta).epsilon
    if dp.target_quantile is None:
      return privacy.epsilon(dp.noise_multiplier, self.sampling_probability,
                             rounds, self.delta, self.accountant)
    return privacy.event_epsilon(privacy.adaptive_clipping_event(
        dp.delta_noise_multiplier, dp.count_noise_std,
        self.sampling_probability, rounds), self.delta, self.accountant)

  def describe(self, rounds: int) -> dict[str, Any]:
    """summary.json's ``privacy`` section: numbers and assumptions."""
    if self.secure is not None:
      return self._describe_secure(rounds)
    dp = self.dp
    return {
        'mechanism': 'gaussian',
        'epsilon': self.epsilon(rounds) if rounds else 0.0,
        'delta': self.delta, 'rounds': rounds,
        'accountant': self.accountant,
        'noise_multiplier': dp.noise_multiplier,
        'delta_noise_multiplier': dp.delta_noise_multiplier,
        'target_epsilon': self.target_epsilon,
        'sampling_probability': self.sampling_probability,
        'population': self.population,
        'noise_cohort_size': dp.noise_cohort_size or dp.denominator,
        'denominator': dp.denominator,
        'not_covered_by_epsilon': NOT_COVERED,
        'adaptive_clipping': None if dp.target_quantile is None else {
            'target_quantile': dp.target_quantile,
            'learning_rate': dp.clip_learning_rate,
            'count_noise_std': dp.count_noise_std},
        'assumptions': (
            'Central DP with a trusted server (McMahan et al. 2018, Alg. 1): '
            "each client's decoded update is clipped to L2 norm C in the "
            'space the server sums, so one client changes the sum by at most '
            'C whatever the upload compression; uniform weights, Gaussian '
            'noise on the sum, a fixed denominator. Adjacency: adding or '
            "removing one client's data (user-level). The accountant (RDP "
            "or PLD, as 'accountant' says; Google's dp_accounting) assumes each client joins each round "
            'independently with probability q = cohort / population '
            '(Poisson sampling); the simulation samples a fixed-size cohort. '
            'The noise and q are those of the noise cohort (a production '
            'cohort of noise_cohort_size clients) while training '
            'denominator clients. Adaptive clipping spends part of z on the '
            'noised count (Andrew et al. 2021, Sec. 3.1).')}


  def _describe_secure(self, rounds: int) -> dict[str, Any]:
    """:meth:`describe` of a distributed mechanism: every parameter its
    epsilon is recomputed from (Kairouz et al. 2021, Prop. 14; Agarwal et
    al. 2021, the Skellam RDP), in parameter units unless named ``scaled``
    (integer steps)."""
    sec, dp = self.secure, self.dp
    acc = None if dp.noise_multiplier == 0 else privacy.secure_epsilon(
        sec, self.sampling_probability, max(rounds, 1), self.delta)
    get = lambda field: None if acc is None else getattr(acc, field)  # noqa: E731
    return {
        'mechanism': sec.mechanism,
        'epsilon': self.epsilon(rounds) if rounds else 0.0,
        'delta': self.delta, 'rounds': rounds, 'accountant': 'rdp',
        'rdp_order': get('order') if rounds else None,
        'noise_multiplier': dp.noise_multiplier,
        'delta_noise_multiplier': dp.noise_multiplier,
        'target_epsilon': self.target_epsilon,
        'sampling_probability': self.sampling_probability,
        'population': self.population, 'clients_per_round': dp.denominator,
        'noise_cohort_size': dp.denominator,
        'denominator': dp.denominator, 'clip_norm': sec.clip_norm,
        'bits': sec.bits, 'gamma': sec.gamma, 'beta': sec.beta,
        'k_stddevs': sec.k_stddevs, 'padded_dim': sec.dim,
        'vector_size': sec.size,
        'local_noise_std': sec.local_std,
        'scaled_local_noise_std': sec.scaled_local_std,
        'central_noise_std': dp.noise_multiplier * sec.clip_norm,
        'rounded_l2_sensitivity': get('l2_sensitivity'),
        'rounded_l1_sensitivity': get('l1_sensitivity'),
        'scaled_rounded_l2_sensitivity': get('scaled_l2_sensitivity'),
        'scaled_rounded_l1_sensitivity': get('scaled_l1_sensitivity'),
        'tau': get('tau'),
        'upload_bits_per_client': sec.bits * sec.dim,
        'not_covered_by_epsilon': NOT_COVERED + ('privacy/wrapped_fraction',),
        'assumptions': (
            'Distributed DP under secure aggregation (Kairouz et al. 2021; '
            'Agarwal et al. 2021): each client clips its update to L2 norm '
            'C, pads it to padded_dim, rotates it with the round\'s shared '
            'random Hadamard transform, scales by 1/gamma, rounds to '
            'integers conditionally (beta), adds its share of discrete noise '
            '(ddgauss: a discrete Gaussian; skellam: a Skellam) and reduces '
            'mod 2^bits; the server sees only the sum mod 2^bits '
            '(simulated exactly, in integers). Adjacency: adding or removing '
            "one client's data (user-level); every client of the round adds "
            'its noise share (no dropouts, honest clients). Epsilon is the '
            "mechanism's RDP bound with the rounded sensitivities, amplified "
            'by Poisson sampling at q = clients_per_round / population (Zhu '
            '& Wang 2019; the simulation samples a fixed-size cohort), '
            "converted by dp_accounting.")}


@functools.lru_cache(maxsize=16)
def _calibrate(target: float, delta: float, q: float, rounds: int,
               accountant: str) -> float:
  try:
    return privacy.calibrate_noise_multiplier(target, delta, q, rounds,
                                              accountant)
  except ValueError as e:
    raise ConfigError(f'--dp_target_epsilon={target}: {e}') from None


def _settings(config: Any, z: float) -> fedopt.DP:
  opts = config.options
  gamma = _opt(opts, DP_ADAPTIVE_QUANTILE)
  m = int(_opt(opts, DP_NOISE_COHORT_SIZE)) or None
  dp = fedopt.DP(
      clip_norm=float(_opt(opts, DP_CLIP)), noise_multiplier=float(z),
      denominator=float(config.clients_per_round),
      noise_cohort_size=None if m is None else float(m),
      target_quantile=None if gamma < 0 else float(gamma),
      clip_learning_rate=CLIP_LEARNING_RATE,
      count_noise_std=(0.0 if gamma < 0 or z == 0 else
                       COUNT_NOISE_FRACTION * _cohort(config)))
  try:
    dp.check()
  except ValueError as e:
    raise ConfigError(f'--dp_adaptive_quantile with z={z}: the count noise '
                      f'(cohort/20) is too small; {e}') from None
  return dp


#: ``id(config) -> (weak reference, (num_train_clients, num_params),
#: Privacy)``.
_RESOLVED: dict[int, tuple[Any, tuple[int, int], Optional[Privacy]]] = {}


def _forget(key: int, ref: Any) -> None:
  if _RESOLVED.get(key, (None,))[0] is ref:
    del _RESOLVED[key]


def resolve(config: Any, num_train_clients: int,
            num_params: int) -> Optional[Privacy]:
  """The :class:`Privacy` of resolved ``config`` (None without DP); the
  population defaults to ``num_train_clients``; ``num_params`` (the
  model's D) sizes a distributed mechanism's vector (:func:`secure_size`).

  Resolved once per config object and population: a later call with the
  same ``config`` object (the builder's, the privacy hook's) returns the
  same :class:`Privacy` without resolving (nor calibrating) again.

  Raises:
    ConfigError: an unreachable ``--dp_target_epsilon``, a population below
      the cohort, or adaptive clipping whose count noise is too small.
  """
  key = id(config)
  hit = _RESOLVED.get(key)
  if hit is not None and hit[0]() is config and hit[1] == (
      num_train_clients, num_params):
    return hit[2]
  out = _resolve(config, num_train_clients, num_params)
  ref = weakref.ref(config, lambda r, k=key: _forget(k, r))
  _RESOLVED[key] = (ref, (num_train_clients, num_params), out)
  return out


def _resolve(config: Any, num_train_clients: int,
             num_params: int) -> Optional[Privacy]:
  """:func:`resolve` without the memo."""
  if not enabled(config):
    return None
  opts = config.options
  population = int(_opt(opts, DP_POPULATION)) or num_train_clients
  try:
    q = privacy.sampling_probability(_accounting_cohort(config), population)
  except ValueError as e:
    raise ConfigError(f'--dp_population / --dp_noise_cohort_size: {e}'
                      ) from None
  delta = float(_opt(opts, DP_DELTA))
  target = float(_opt(opts, DP_TARGET_EPSILON)) or None
  z = float(_opt(opts, DP_NOISE_MULTIPLIER))
  accountant = str(_opt(opts, DP_ACCOUNTANT))
  if mechanism(config) != 'gaussian':
    return _resolve_secure(config, num_params, z, delta, q, population,
                           target)
  if target is not None:
    z = _calibrate(target, delta, q, int(config.num_rounds), accountant)
  return Privacy(_settings(config, z), delta, q, population, target,
                 accountant)


def secure_size(config: Any, num_params: int) -> int:
  """The length of the vector each client secure-sums: the intrinsic
  dimension under ``igc_static``, else the model's ``num_params``."""
  if config.algorithm.startswith('igc'):
    return int(config.options['intrinsic_dim'])
  return int(num_params)


def _resolve_secure(config: Any, num_params: int, z: float, delta: float,
                    q: float, population: int,
                    target: Optional[float]) -> Privacy:
  """:func:`resolve` of ``--dp_mechanism=ddgauss|skellam``: z (or its
  calibration to ``target``), then gamma and the local std."""
  opts = config.options
  args = dict(mechanism=mechanism(config), clip_norm=float(_opt(opts, DP_CLIP)),
              bits=int(_opt(opts, DP_BITS)),
              beta=float(_opt(opts, DP_ROUNDING_BETA)),
              clients=int(config.clients_per_round),
              size=secure_size(config, num_params),
              k_stddevs=_k_stddevs(config))
  try:
    if target is not None:
      z = privacy.calibrate_secure(target_epsilon=target, delta=delta,
                                        q=q, rounds=int(config.num_rounds),
                                        **args)
    secure = privacy.secure_settings(noise_multiplier=z, **args)
  except ValueError as e:
    flag = ('--dp_target_epsilon' if target is not None else
            '--dp_bits')
    raise ConfigError(f'{flag}: {e}') from None
  return Privacy(_settings(config, z), delta, q, population, target, 'rdp',
                 secure)
