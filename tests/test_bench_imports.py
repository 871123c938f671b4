"""No import cycle among the scripts of ``benchmarks/``.

The scripts import each other as top-level modules (``benchmarks/`` on
``sys.path``); the imports are read from their syntax trees (function
bodies included), so nothing is executed.
"""

from __future__ import annotations

import ast
import pathlib


def _imports(path: pathlib.Path, names: set[str]) -> set[str]:
  found = set()
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      found |= {a.name.split('.')[0] for a in node.names}
    elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
      found.add(node.module.split('.')[0])
  return found & names


def _cycle(graph: dict[str, set[str]]) -> list[str]:
  """A cycle of ``graph`` as a list of nodes, or [] when there is none."""
  state: dict[str, int] = {}  # 1: on the current path, 2: done.
  path: list[str] = []

  def visit(node: str) -> list[str]:
    state[node] = 1
    path.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return path[path.index(nxt):] + [nxt]
      if nxt not in state and (found := visit(nxt)):
        return found
    path.pop()
    state[node] = 2
    return []

  for node in sorted(graph):
    if node not in state and (found := visit(node)):
      return found
  return []


def test_cycle_finder():
  assert _cycle({'a': {'b'}, 'b': set()}) == []
  assert _cycle({'a': {'b'}, 'b': {'c'}, 'c': {'a'}}) == ['a', 'b', 'c', 'a']
  assert _cycle({'a': {'a'}}) == ['a', 'a']


def test_benchmarks_have_no_import_cycle(repo_root):
  scripts = {p.stem: p for p in (repo_root / 'benchmarks').glob('*.py')}
  graph = {name: _imports(p, set(scripts)) - {name}
           for name, p in scripts.items()}
  assert graph['bench_rounds'] == {'trace_summary'}
  assert _cycle(graph) == [], graph
