"""The package's layering, read from the source, and the algorithm registry.

Layers, bottom to top: ``fedlite_jax.transforms`` (compression and its
kernels, plain JAX) -> ``fedlite_jax.models`` (flax models and FedLite's VQ
layer) -> ``fedlite_jax.algorithms`` (FedJAX algorithm builders) ->
``fedlite_jax.training`` (the runner library) -> ``experiments/`` (binaries,
and libraries only they use, such as the gradient-inversion attack).
These tests check that

  * the graph of import-time imports among ``fedlite_jax`` modules has no
    cycle (an import inside a function body runs later and is not an edge);
  * no layer imports one above it, at import time or inside a function;
  * no module registers an algorithm at import: the built-in algorithms are
    the ``SPECS`` of the modules in ``registry.BUILTIN_MODULES``, and
    ``registry.register`` adds a user's own at run time.

Only the registry tests import the package; the others read files with ast.
"""

from __future__ import annotations

import ast
import pathlib
import re
from typing import Iterator, Optional

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = 'fedlite_jax'


def module_name(path: pathlib.Path) -> str:
  """Dotted name of a file under ROOT (``pkg/__init__.py`` -> ``pkg``)."""
  parts = list(path.relative_to(ROOT).with_suffix('').parts)
  if parts[-1] == '__init__':
    parts.pop()
  return '.'.join(parts)


def package_modules() -> dict[str, pathlib.Path]:
  """Every module of the package: dotted name -> file."""
  return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob('*.py'))}


def _is_type_checking(node: ast.If) -> bool:
  test = node.test
  return ((isinstance(test, ast.Name) and test.id == 'TYPE_CHECKING') or
          (isinstance(test, ast.Attribute) and test.attr == 'TYPE_CHECKING'))


def _import_nodes(tree: ast.AST, import_time_only: bool) -> Iterator[ast.AST]:
  """Import statements; with ``import_time_only``, not those in functions.

  Class bodies and top-level ``if``/``try`` blocks run at import time and
  are searched; ``if TYPE_CHECKING:`` blocks never run and are skipped.
  """
  stack = [tree]
  while stack:
    node = stack.pop()
    if isinstance(node, (ast.Import, ast.ImportFrom)):
      yield node
      continue
    if import_time_only and isinstance(
        node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
      continue
    if isinstance(node, ast.If) and _is_type_checking(node):
      stack.extend(node.orelse)
      continue
    stack.extend(ast.iter_child_nodes(node))


def imported_names(module: str, path: pathlib.Path,
                   import_time_only: bool) -> set[str]:
  """Dotted names ``module`` imports (``from a import b`` gives ``a.b``).

  Relative imports are resolved against ``module``. ``a.b`` may name a
  module, a package or an attribute of ``a``; :func:`resolve` decides.
  ``from a import b`` is not counted as an import of the package ``a``
  itself (Python runs ``a/__init__.py`` first, but a package that imports
  its own submodules would otherwise always be a cycle).
  """
  tree = ast.parse(path.read_text(), filename=str(path))
  is_package = path.name == '__init__.py'
  names = set()
  for node in _import_nodes(tree, import_time_only):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
      continue
    base = node.module or ''
    if node.level:
      anchor = module.split('.')
      drop = node.level - 1 if is_package else node.level
      anchor = anchor[:len(anchor) - drop]
      base = '.'.join(anchor + ([base] if base else []))
    names.update(base if alias.name == '*' else f'{base}.{alias.name}'
                 for alias in node.names)
  return names


def resolve(name: str, modules: dict[str, pathlib.Path]) -> Optional[str]:
  """The package module that importing ``name`` reads, or None (external).

  ``fedlite_jax.x.y`` resolves to the longest prefix that is a module
  (``from fedlite_jax.training.config import ConfigError`` -> ``...config``).
  """
  parts = name.split('.')
  for end in range(len(parts), 0, -1):
    candidate = '.'.join(parts[:end])
    if candidate in modules:
      return candidate
  return None


def import_graph(import_time_only: bool) -> dict[str, set[str]]:
  """Module -> package modules it imports (self-edges dropped)."""
  modules = package_modules()
  graph = {}
  for module, path in modules.items():
    targets = {resolve(n, modules)
               for n in imported_names(module, path, import_time_only)}
    graph[module] = {t for t in targets if t is not None and t != module}
  return graph


def find_cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
  """A cycle ``[a, b, ..., a]`` of ``graph``, or None (iterative DFS)."""
  state = {}  # module -> 1 on the current path, 2 finished.
  for start in sorted(graph):
    if start in state:
      continue
    path = [start]
    state[start] = 1
    pending = [iter(sorted(graph[start]))]
    while pending:
      nxt = next(pending[-1], None)
      if nxt is None:
        state[path.pop()] = 2
        pending.pop()
        continue
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      if nxt not in state:
        state[nxt] = 1
        path.append(nxt)
        pending.append(iter(sorted(graph.get(nxt, ()))))
  return None


def external_imports(package: str) -> dict[str, set[str]]:
  """Module of ``package`` -> every name it imports (functions included)."""
  modules = package_modules()
  return {m: imported_names(m, p, import_time_only=False)
          for m, p in modules.items()
          if m == package or m.startswith(package + '.')}


def violations(package: str, forbidden: tuple[str, ...]) -> list[str]:
  """``'module -> name'`` for each import of a ``forbidden`` name (or below)."""
  out = []
  for module, names in sorted(external_imports(package).items()):
    for name in sorted(names):
      if any(name == f or name.startswith(f + '.') for f in forbidden):
        out.append(f'{module} -> {name}')
  return out


def _import_time_statements(tree: ast.Module) -> Iterator[ast.stmt]:
  """Top-level statements, without function and class definitions."""
  for node in tree.body:
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef,
                             ast.ClassDef)):
      yield node


# --- the helpers themselves, on a small tree -------------------------------

def test_find_cycle_reports_the_cycle_and_none_for_a_dag():
  assert find_cycle({'a': {'b'}, 'b': {'c'}, 'c': set()}) is None
  assert find_cycle({'a': {'b', 'c'}, 'b': {'c'}, 'c': set()}) is None
  cycle = find_cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}})
  assert cycle is not None and cycle[0] == cycle[-1]
  assert set(cycle) == {'a', 'b', 'c'} and len(cycle) == 4
  assert find_cycle({'a': {'a'}}) == ['a', 'a']


def test_imported_names_skips_function_bodies_and_type_checking(tmp_path):
  pkg = tmp_path / PACKAGE / 'sub'
  pkg.mkdir(parents=True)
  source = pkg / 'mod.py'
  source.write_text(
      'import os\n'
      'from typing import TYPE_CHECKING\n'
      'from . import sibling\n'
      'from .. import top\n'
      'if TYPE_CHECKING:\n'
      '  from fedlite_jax import hidden\n'
      'try:\n'
      '  import fedlite_jax.guarded\n'
      'except ImportError:\n'
      '  pass\n'
      'def f():\n'
      '  from fedlite_jax import late\n')
  names = imported_names('fedlite_jax.sub.mod', source, import_time_only=True)
  assert names == {'os', 'typing.TYPE_CHECKING', 'fedlite_jax.sub.sibling',
                   'fedlite_jax.top', 'fedlite_jax.guarded'}
  init = pkg / '__init__.py'
  init.write_text('from . import mod\nfrom .mod import thing\n')
  assert imported_names('fedlite_jax.sub', init, import_time_only=True) == {
      'fedlite_jax.sub.mod', 'fedlite_jax.sub.mod.thing'}
  everything = imported_names('fedlite_jax.sub.mod', source,
                              import_time_only=False)
  assert everything == names | {'fedlite_jax.late'}


def test_resolve_picks_the_longest_module_prefix():
  modules = {'fedlite_jax': None, 'fedlite_jax.training': None,
             'fedlite_jax.training.config': None}
  assert resolve('fedlite_jax.training.config.ConfigError',
                 modules) == 'fedlite_jax.training.config'
  assert resolve('fedlite_jax.training.RunConfig',
                 modules) == 'fedlite_jax.training'
  assert resolve('fedjax.core', modules) is None


# --- the package ------------------------------------------------------------

def test_the_package_is_found():
  modules = package_modules()
  assert {'fedlite_jax', 'fedlite_jax.training.registry',
          'fedlite_jax.transforms', 'fedlite_jax.algorithms.fedopt'} <= set(
              modules)


def test_the_checks_see_real_edges():
  # Guards against checks that pass because they read nothing.
  graph = import_graph(import_time_only=True)
  training = 'fedlite_jax.training.'
  assert training + 'algo_lm' in graph[training + 'registry']
  assert training + 'spec' in graph[training + 'algo_lm']
  graph[training + 'spec'].add(training + 'registry')
  assert find_cycle(graph) is not None
  assert violations('fedlite_jax.training', ('fedlite_jax.algorithms',))
  assert violations('fedlite_jax.algorithms', ('fedjax',))


def test_import_time_imports_have_no_cycle():
  cycle = find_cycle(import_graph(import_time_only=True))
  assert cycle is None, 'import cycle: ' + ' -> '.join(cycle)


def test_training_has_no_cycle_even_through_function_level_imports():
  graph = import_graph(import_time_only=False)
  training = {m: {t for t in targets if t.startswith('fedlite_jax.training')}
              for m, targets in graph.items()
              if m.startswith('fedlite_jax.training')}
  cycle = find_cycle(training)
  assert cycle is None, 'import cycle: ' + ' -> '.join(cycle)


def test_transforms_import_neither_fedjax_nor_higher_layers():
  # Kernels (FWHT, Fastfood, PQ, k-means) live here, beside the transforms
  # that use them: plain JAX, no model library.
  bad = violations('fedlite_jax.transforms',
                   ('fedjax', 'flax', 'haiku', 'fedlite_jax.models',
                    'fedlite_jax.algorithms', 'fedlite_jax.training',
                    'fedlite_jax.rounds'))
  assert not bad, 'layering: ' + '; '.join(bad)


def test_models_import_no_algorithm_layer():
  # The VQ layer is a model layer: models use transforms' kernels, never
  # the algorithms, round engines or the runner.
  bad = violations('fedlite_jax.models',
                   ('fedlite_jax.algorithms', 'fedlite_jax.training',
                    'fedlite_jax.rounds'))
  assert not bad, 'layering: ' + '; '.join(bad)


def test_the_package_is_organized_by_layer_not_by_paper():
  # FedLite's and IGC's pieces live in their layers (transforms, models,
  # algorithms, experiments); there are no per-paper subpackages.
  modules = package_modules()
  assert not [m for m in modules
              if m.startswith(('fedlite_jax.igc', 'fedlite_jax.fedlite'))]
  assert {'fedlite_jax.transforms.fwht', 'fedlite_jax.transforms.fastfood',
          'fedlite_jax.transforms.pq', 'fedlite_jax.transforms.kmeans',
          'fedlite_jax.transforms.reparameterization',
          'fedlite_jax.models.vq_layer'} <= set(modules)


def test_algorithms_do_not_import_training():
  bad = violations('fedlite_jax.algorithms', ('fedlite_jax.training',))
  assert not bad, 'layering: ' + '; '.join(bad)


def test_nothing_in_the_package_imports_experiments():
  bad = violations(PACKAGE, ('experiments',))
  assert not bad, 'layering: ' + '; '.join(bad)


#: ``--name`` (a command-line flag) inside a string.
_FLAG = re.compile(r'(?<![\w-])--[a-z][a-z0-9_]*')


def test_layers_below_the_runner_name_no_flags():
  """rounds/, algorithms/, transforms/ and datasets/ speak of values
  (``num_devices=3``); the runner and binaries name their flags."""
  bad = []
  for sub in ('rounds', 'algorithms', 'transforms', 'datasets'):
    for path in sorted((ROOT / PACKAGE / sub).rglob('*.py')):
      tree = ast.parse(path.read_text(), filename=str(path))
      for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
          for flag in _FLAG.findall(node.value):
            bad.append(f'{path.relative_to(ROOT)}:{node.lineno}: {flag}')
  assert not bad, 'flag names below the runner: ' + '; '.join(bad)


def test_algorithm_modules_of_training_do_not_import_each_other():
  graph = import_graph(import_time_only=False)
  algo = {m for m in graph if m.startswith('fedlite_jax.training.algo_')}
  bad = [f'{m} -> {t}' for m in sorted(algo) for t in sorted(graph[m])
         if t in algo or t == 'fedlite_jax.training.registry']
  assert not bad, ('an algorithm module imports another one or the '
                   'registry: ' + '; '.join(bad))


def test_no_module_registers_at_import():
  """Built-in algorithms are data (``SPECS``), not import-time calls."""
  bad = []
  for module, path in package_modules().items():
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in _import_time_statements(tree):
      for call in ast.walk(node):
        if (isinstance(call, ast.Call) and
            getattr(call.func, 'attr', getattr(call.func, 'id', None))
            == 'register'):
          bad.append(f'{module}:{call.lineno}')
  assert not bad, 'register() called at import time: ' + ', '.join(bad)


# --- the registry built from SPECS -------------------------------------------

def test_registry_lists_the_specs_of_its_modules_in_order():
  from fedlite_jax.training import registry
  assert list(registry.algorithms()) == [
      'fedavg', 'fedprox', 'mime_lite', 'sgd', 'topk', 'fetchsgd',
      'igc_static', 'igc_k_subspace', 'igc_time_varying',
      'igc_k_subspace_time_varying', 'splitfed', 'fedlite']
  for module in registry.BUILTIN_MODULES:
    for spec in module.SPECS:
      assert registry.get(spec.name) is spec


def test_register_adds_a_users_algorithm_and_refuses_clashes(monkeypatch):
  from fedlite_jax.training import compression_options
  from fedlite_jax.training import registry
  monkeypatch.setattr(registry, '_ADDED', {})
  builtin = dict(registry.algorithms())
  mine = registry.AlgorithmSpec(
      name='my_sgd', description='test', build=lambda ctx: None,
      options=(compression_options.LOCAL_STEPS,  # shared, identical: allowed
               registry.Option('my_option', 3, 'help')))
  assert registry.register(mine) is mine
  assert registry.get('my_sgd') is mine
  assert list(registry.algorithms()) == list(builtin) + ['my_sgd']
  assert registry.all_options()['my_option'].default == 3
  with pytest.raises(ValueError, match="'my_sgd' is already registered"):
    registry.register(mine)
  with pytest.raises(ValueError, match="'fedavg' is already registered"):
    registry.register(builtin['fedavg'])
  changed = registry.Option('local_steps', 1, 'other default')
  with pytest.raises(ValueError, match='--local_steps of .other.'):
    registry.register(registry.AlgorithmSpec(
        name='other', description='test', build=lambda ctx: None,
        options=(changed,)))
  assert 'other' not in registry.algorithms()
  with pytest.raises(ValueError, match="allowed values are fedavg, "):
    registry.get('nope')


def test_config_and_runner_name_no_algorithm():
  """What an algorithm ignores or how it runs its clients is its spec's
  (``ignored_fields``, ``clients_vmapped``, ``model_overrides``)."""
  from fedlite_jax.training import config
  from fedlite_jax.training import registry
  optimizers = set(config.CLIENT_OPTIMIZERS) | set(config.SERVER_OPTIMIZERS)
  for name in ('config.py', 'runner.py'):
    text = (ROOT / PACKAGE / 'training' / name).read_text()
    named = [a for a in registry.algorithms() if a not in optimizers and
             (f"'{a}'" in text or f'"{a}"' in text)]
    assert not named, f'training/{name} names algorithms {named}'


def test_spec_says_whether_clients_run_vmapped():
  import types
  from fedlite_jax.training import registry
  fedavg, split = registry.get('fedavg'), registry.get('splitfed')
  auto = types.SimpleNamespace(conv_implementation='auto', options={})
  assert fedavg.clients_vmapped(auto, 'vmap')
  assert not fedavg.clients_vmapped(auto, 'loop')
  assert fedavg.model_overrides(auto, 'loop') == {'conv_implementation': 'lax'}
  assert fedavg.uses_round_engine() and not split.uses_round_engine()
  for execution, vmapped in (('vmap', True), ('unroll', False)):
    config = types.SimpleNamespace(
        conv_implementation='auto',
        options={'split_client_execution': execution})
    for engine in ('vmap', 'loop'):
      assert split.clients_vmapped(config, engine) is vmapped
      assert split.model_overrides(config, engine) == {
          'conv_implementation': 'im2col' if vmapped else 'lax'}
  fixed = types.SimpleNamespace(conv_implementation='lax', options={})
  assert split.model_overrides(fixed, 'vmap') == {}
  assert 'split_client_execution' in split.ignored_reason('round_engine')
  assert split.ignored_reason('client_lr') is None


def test_subpackages_reachable_from_the_top_level_import():
  """``import fedlite_jax`` then ``fedlite_jax.datasets.load_federated_data``
  (the README's spelling), as jax / flax / optax allow; lazily, in a fresh
  interpreter so no other test has imported the subpackages yet."""
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  code = ('import sys, fedlite_jax; '
          'assert "fedlite_jax.training" not in sys.modules; '
          'print(fedlite_jax.datasets.load_federated_data.__name__, '
          'fedlite_jax.transforms.top_k.__name__, '
          'fedlite_jax.algorithms.federated_averaging.__name__, '
          'fedlite_jax.rounds.make_engine.__name__, '
          'fedlite_jax.models.create_emnist_cnn.__name__, '
          'fedlite_jax.training.run.__name__); '
          'fedlite_jax.no_such_thing')
  proc = subprocess.run([sys.executable, '-c', code], capture_output=True,
                        text=True, check=False)
  assert proc.stdout.split() == ['load_federated_data', 'top_k',
                                 'federated_averaging', 'make_engine',
                                 'create_emnist_cnn', 'run']
  assert "has no attribute 'no_such_thing'" in proc.stderr


def test_the_runner_is_short_and_its_functions_are_small():
  """runner.py is the top of the house (<= 200 lines); no function of
  training/ is over 80 lines (the loop's duties live in hooks/)."""
  runner = ROOT / PACKAGE / 'training' / 'runner.py'
  assert len(runner.read_text().splitlines()) <= 200
  long = []
  for path in sorted((ROOT / PACKAGE / 'training').rglob('*.py')):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        if node.end_lineno - node.lineno + 1 > 80:
          long.append(f'{path.name}:{node.name}')
  assert not long, long
