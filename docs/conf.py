"""Sphinx configuration: the user guide, notes, notebooks and API reference.

Build (warnings are errors, as in CI):

  pip install -e ".[docs]"
  sphinx-build -W -b html docs docs/_build/html

Pages are Markdown (MyST) or reStructuredText. The notebooks
(``notebooks/``) and the generated results (``experiments/results/``,
``benchmarks/results/``) are copied into ``docs/notebooks`` and
``docs/generated`` when a build starts (git ignores both) and rendered as
they are, without executing anything. Pages link them by their repository
paths (``../notebooks/x.ipynb``), which work on GitHub; the build points
those links at the copies.
"""

import pathlib
import re
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # The checkout's fedlite_jax, even uninstalled.

project = 'fedlite_jax'
author = 'fedlite_jax authors'
copyright = '2025, fedlite_jax authors'  # pylint: disable=redefined-builtin

extensions = [
    'myst_nb',  # Markdown pages (MyST) and notebooks.
    'sphinx.ext.autodoc',
    'sphinx.ext.napoleon',  # Google-style docstrings.
    'sphinx.ext.viewcode',
]

source_suffix = {'.rst': 'restructuredtext', '.md': 'myst-nb',
                 '.ipynb': 'myst-nb'}
exclude_patterns = ['_build', '**.ipynb_checkpoints']
root_doc = 'index'

# MyST: ``$...$`` math, ``:::`` fences, heading anchors for #links.
myst_enable_extensions = ['dollarmath', 'colon_fence']
myst_heading_anchors = 3

# Notebooks are rendered with their stored outputs, never executed here
# (CI executes them under pytest --nbmake).
nb_execution_mode = 'off'

# Docstrings: Google style; shapes, units and errors are in the text.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True
autodoc_default_options = {'member-order': 'bysource'}
autodoc_typehints = 'none'  # Docstrings state shapes and dtypes.
autodoc_preserve_defaults = True
autodoc_mock_imports = []

html_theme = 'sphinx_book_theme'
html_title = 'fedlite_jax'
html_theme_options = {
    'show_toc_level': 2,
    'home_page_in_toc': True,
}


# -- Re-exported names ---------------------------------------------------------
# Each object is documented once, in the module that defines it
# (``fedlite_jax.transforms.base.chain``). A reference through a package that
# re-exports it (``fedlite_jax.transforms.chain``, or ``chain`` in that
# package's docstring) is resolved to that definition.

def _canonical_name(target, module):
  """Dotted name of the definition ``target`` denotes from ``module``."""
  import importlib  # pylint: disable=g-import-not-at-top
  import inspect  # pylint: disable=g-import-not-at-top
  target = target.lstrip('~.')
  candidates = [target]
  parts = (module or '').split('.')
  while parts and parts[0]:
    candidates.append('.'.join(parts + [target]))
    parts = parts[:-1]
  for name in candidates:
    if not name.startswith('fedlite_jax'):
      continue
    pieces = name.split('.')
    for cut in range(len(pieces), 0, -1):
      try:
        obj = importlib.import_module('.'.join(pieces[:cut]))
      except ImportError:
        continue
      try:
        for attr in pieces[cut:]:
          obj = getattr(obj, attr)
      except AttributeError:
        break
      if inspect.ismodule(obj):
        return obj.__name__
      owner = getattr(obj, '__module__', None)
      qualname = getattr(obj, '__qualname__', None)
      if owner and qualname:
        return f'{owner}.{qualname}'
      break
  return None


def _resolve_reexport(app, env, node, contnode):
  if node.get('refdomain') != 'py':
    return None
  canonical = _canonical_name(node['reftarget'], node.get('py:module'))
  if not canonical or canonical == node['reftarget']:
    return None
  domain = env.get_domain('py')
  return domain.resolve_xref(env, node['refdoc'], app.builder,
                             node['reftype'], canonical, node, contnode)


# -- Notebooks and generated results --------------------------------------------

# docs/<copy> <- repository folder, and the files copied from it.
_COPIES = {
    'notebooks': ('notebooks', ('*.ipynb',)),
    'generated/experiments': ('experiments/results', ('*.md', '*.png')),
    'generated/benchmarks': ('benchmarks/results', ('*.md', '*.png')),
}


def _copy_sources(app, config):
  del config
  for copy, (folder, patterns) in _COPIES.items():
    target = pathlib.Path(app.srcdir) / copy
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    for pattern in patterns:
      for path in sorted((ROOT / folder).glob(pattern)):
        shutil.copy2(path, target / path.name)


def _point_links_at_copies(app, docname, source):
  """Repository-relative links, rewritten for the build.

  In pages written for docs/: ``](../experiments/results/x.md)`` ->
  ``](generated/experiments/x.md)`` (relative to the page). In the copies:
  ``](../../docs/x.md)`` (from the repository folder into docs/) ->
  ``](../../x.md)``.
  """
  del app
  if docname.startswith(tuple(f'{copy}/' for copy in _COPIES)):
    depth = docname.count('/')
    source[0] = source[0].replace('](' + '../' * depth + 'docs/',
                                  '](' + '../' * depth)
    return
  up = '../' * docname.count('/')
  for copy, (folder, _) in _COPIES.items():
    source[0] = re.sub(rf'\]\({re.escape(up)}\.\./{re.escape(folder)}/',
                       f']({up}{copy}/', source[0])


def setup(app):
  app.connect('config-inited', _copy_sources)
  app.connect('source-read', _point_links_at_copies)
  app.connect('missing-reference', _resolve_reexport)
