"""BUILD stays in sync with the code: every module, binary and test is named.

Independent expectation: the files on disk. A new module that is not added to
a BUILD target (or a target naming a deleted file) fails here.
"""

import pathlib
import re

_QUOTED_PY = re.compile(r'"([\w/.-]+\.py)"')
_TARGET = re.compile(r'^(py_library|py_binary|py_test)\(\s*\n\s*name = "([\w-]+)"',
                     re.M)


def _build_text(repo_root: pathlib.Path) -> str:
  return (repo_root / 'BUILD').read_text()


def _on_disk(repo_root: pathlib.Path, folder: str, pattern: str) -> set[str]:
  return {str(p.relative_to(repo_root)) for p in (repo_root / folder).rglob(pattern)
          if '__pycache__' not in p.parts}


def test_every_source_file_is_named_exactly_once(repo_root):
  named = _QUOTED_PY.findall(_build_text(repo_root))
  duplicates = {p for p in named if named.count(p) > 1}
  assert not duplicates, f'named twice in BUILD: {sorted(duplicates)}'
  expected = (_on_disk(repo_root, 'fedlite_jax', '*.py')
              | _on_disk(repo_root, 'experiments', '*.py')
              | _on_disk(repo_root, 'benchmarks', '*.py')
              | _on_disk(repo_root, 'tests', '*.py'))
  missing = sorted(expected - set(named))
  stale = sorted(set(named) - expected)
  assert not missing, f'files missing from BUILD: {missing}'
  assert not stale, f'BUILD names files that do not exist: {stale}'


def test_each_test_file_has_its_own_py_test(repo_root):
  text = _build_text(repo_root)
  tests = {p.stem for p in (repo_root / 'tests').glob('test_*.py')}
  targets = {name for kind, name in _TARGET.findall(text) if kind == 'py_test'}
  assert tests <= targets, f'no py_test for: {sorted(tests - targets)}'
  binaries = {name for kind, name in _TARGET.findall(text) if kind == 'py_binary'}
  assert 'run_experiment' in binaries
