"""The user documentation speaks to users, not to the project's own history.

README.md and the pages written for users (``docs/*.md``, ``docs/api/*``;
not the maintainer notes under ``docs/notes/``) carry no issue numbers, no
commit hashes and no removed flag, except the "Removed flags" section of
the runner's guide, which lists each removed flag with its replacement.
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

ISSUE = re.compile(r'\bissue [0-9]', re.I)
# 7-40 lowercase hex digits holding at least one digit and one letter: an
# abbreviated or full git commit hash (plain numbers and words stay out).
COMMIT = re.compile(
    r'\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b')
# Flags, settings and modules removed from the round engines.
REMOVED = ('segment_loop', 'data_on_device', 'steps_per_call',
           'clients_per_chunk', 'cpu_allocator', 'FEDLITE_CPU_HUGE_PAGES',
           'FEDLITE_CPU_ALLOCATOR', 'device_rows', 'RowTable')
# The one place that may name them: the runner guide's list.
REMOVED_LIST = ('docs/runner.md', '## Removed flags')


def user_pages() -> list[pathlib.Path]:
  """README.md and the documentation pages written for users."""
  docs = ROOT / 'docs'
  return [ROOT / 'README.md'] + sorted(docs.glob('*.md')) + sorted(
      p for p in (docs / 'api').iterdir() if p.suffix in ('.md', '.rst'))


def _name(page: pathlib.Path) -> str:
  return page.relative_to(ROOT).as_posix()


def _without_removed_list(page: pathlib.Path, text: str) -> str:
  """``text`` without the runner guide's "Removed flags" section."""
  if _name(page) != REMOVED_LIST[0]:
    return text
  start = text.index(REMOVED_LIST[1] + '\n')
  end = text.find('\n## ', start + 1)
  return text[:start] + (text[end:] if end >= 0 else '')


def _hits(pattern: re.Pattern, text: str) -> list[str]:
  return [f'line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}'
          for m in pattern.finditer(text)]


def test_the_user_pages_are_found():
  names = {_name(p) for p in user_pages()}
  assert {'README.md', 'docs/performance.md', 'docs/runner.md',
          'docs/api/rounds.rst'} <= names
  assert not any(n.startswith('docs/notes/') for n in names)


@pytest.mark.parametrize('page', user_pages(), ids=_name)
def test_no_issue_numbers_or_commit_hashes(page):
  text = page.read_text()
  assert not _hits(ISSUE, text), f'{_name(page)}: {_hits(ISSUE, text)}'
  assert not _hits(COMMIT, text), f'{_name(page)}: {_hits(COMMIT, text)}'


@pytest.mark.parametrize('page', user_pages(), ids=_name)
def test_removed_flags_only_in_the_runner_guides_list(page):
  text = _without_removed_list(page, page.read_text())
  found = [name for name in REMOVED if name in text]
  assert not found, f'{_name(page)} names removed {found}'


def test_the_runner_guide_lists_each_removed_engine_flag():
  text = (ROOT / REMOVED_LIST[0]).read_text()
  start = text.index(REMOVED_LIST[1] + '\n')
  end = text.find('\n## ', start + 1)
  section = text[start:end if end >= 0 else None]
  for name in ('segment_loop', 'data_on_device', 'steps_per_call'):
    assert f'`--{name}' in section, name


def test_the_patterns_catch_what_they_are_for():
  assert _hits(ISSUE, 'blocked by issue 30')
  assert _hits(COMMIT, 'measured at 2b19688 on one H200')
  assert _hits(COMMIT, 'git show 86eacf5:fedlite_jax/rounds/streaming.py')
  for clean in ('17179869184', 'a deadbeef value', '1,206,590 parameters',
                'lowbias32', 'Table 2'):
    assert not _hits(COMMIT, clean) and not _hits(ISSUE, clean), clean
