"""Regenerates BUILD from the source tree: python tools/gen_build.py.

Run after adding or removing a module, binary or test; tests/test_build.py
fails while BUILD is out of date. New subpackages need an entry in pkgs.
"""
import pathlib
import subprocess

# Files in git's index (tracked or staged): `git add` new modules first.
_INDEX = set(subprocess.run(['git', 'ls-files'], capture_output=True, text=True,
                            check=True).stdout.split())


def files(folder):
  return sorted(str(p) for p in pathlib.Path(folder).glob('*.py')
                if str(p) in _INDEX)
pkgs = {  # target name -> (folder, deps, doc)
  'fedlite_jax': ('fedlite_jax', [], 'Package root and the FedJAX compatibility layer.'),
  'datasets': ('fedlite_jax/datasets', [':fedlite_jax'], 'Federated datasets (FedJAX/TFF formats, embedded MNIST).'),
  'models': ('fedlite_jax/models', [':fedlite_jax', ':transforms'], 'Split-ready flax models and the FedLite VQ layer.'),
  'rounds': ('fedlite_jax/rounds', [':fedlite_jax'], 'Round engines (loop / vmap).'),
  'comm': ('fedlite_jax/comm', [], 'Communication ledger.'),
  'algorithms': ('fedlite_jax/algorithms', [':fedlite_jax', ':rounds', ':transforms', ':models'], 'Federated algorithms (FedJAX FederatedAlgorithm builders).'),
  'transforms': ('fedlite_jax/transforms', [':fedlite_jax'], 'Composable compression transforms with bit costs, their kernels (FWHT, Fastfood, grouped PQ, k-means) and the intrinsic reparameterization.'),
  'training': ('fedlite_jax/training', [':algorithms', ':comm', ':datasets', ':models'], 'Training package: the experiment runner library.'),
}
ext = {
  'fedlite_jax': ['jax', 'numpy', 'fedjax'], 'datasets': ['fedjax', 'numpy', 'h5py', 'mlxtend', 'absl-py', 'msgpack'],
  'models': ['flax', 'jax', 'fedjax'], 'rounds': ['jax', 'numpy'], 'comm': [], 'algorithms': ['absl-py', 'fedjax', 'jax', 'numpy', 'optax'],
  'transforms': ['jax', 'numpy'],
  'training': ['absl-py', 'fedjax', 'flax', 'jax', 'matplotlib', 'numpy', 'optax',
               'orbax-checkpoint', 'tensorboardX', 'tqdm'],
}
out = ['# Bazel targets (rules_python). tests/test_build.py checks that every module,',
       '# binary and test file is named here exactly once.', '',
       'load("@pip//:requirements.bzl", "requirement")',
       'load("@rules_python//python:defs.bzl", "py_binary", "py_library", "py_test")', '',
       'package(default_visibility = ["//visibility:public"])', '']
def lst(items, indent=8):
  return '\n'.join(' ' * indent + f'"{i}",' for i in items)
def deps(local, pip):
  return [*local, *[f'requirement("{p}")' for p in pip]]
def dep_lines(d):
  return '\n'.join(' ' * 8 + (x if x.startswith('requirement') else f'"{x}"') + ',' for x in d)
for name, (folder, local, doc) in pkgs.items():
  srcs = files(folder)
  if not srcs:
    continue
  local = [l for l in local if files(pkgs[l[1:]][0])]
  out += [f'# {doc}', 'py_library(', f'    name = "{name}",', '    srcs = [', lst(srcs), '    ],',
          '    deps = [', dep_lines(deps(local, ext[name])), '    ],', ')', '']
# Libraries of the binaries: provenance (shared), the gradient-inversion attack
# (igc_privacy's).
EXPERIMENT_LIBS = ('experiments/gradient_inversion.py', 'experiments/provenance.py')
for p in EXPERIMENT_LIBS:
  out += ['py_library(', f'    name = "{pathlib.Path(p).stem}",', f'    srcs = ["{p}"],',
          '    deps = [":training"],', ')', '']
for p in files('experiments'):
  if p in EXPERIMENT_LIBS:
    continue
  n = pathlib.Path(p).stem
  lib_deps = [f'":{pathlib.Path(q).stem}"' for q in EXPERIMENT_LIBS
              if f'import {pathlib.Path(q).stem}' in pathlib.Path(p).read_text()]
  out += ['py_binary(', f'    name = "{n}",', f'    srcs = ["{p}"],',
          '    data = glob(["experiments/configs/*.flags"]),',
          f'    deps = [":training"{"".join(", " + d for d in lib_deps)}],', ')', '']
# Benchmark helpers (no main) go in the srcs of the script that imports them.
BENCH_HELPERS = {'benchmarks/trace_summary.py': 'bench_rounds'}
for p in files('benchmarks'):
  n = pathlib.Path(p).stem
  if p in BENCH_HELPERS:
    continue
  srcs = [p] + [h for h, owner in BENCH_HELPERS.items() if owner == n]
  out += ['py_binary(', f'    name = "{n}",', '    srcs = [', lst(srcs), '    ],',
          '    deps = [":training"],', ')', '']
out += ['py_library(', '    name = "test_support",', '    testonly = True,', '    srcs = ["tests/conftest.py"],',
        '    deps = [":fedlite_jax", requirement("pytest")],', ')', '']
for p in files('tests'):
  n = pathlib.Path(p).stem
  if n == 'conftest':
    continue
  big = n in ('test_runner', 'test_fedavg', 'test_compat', 'test_runner_resume',
               'test_init_checkpoint', 'test_bad_inputs',
               'test_regression_runner', 'test_compressed_backend')
  out += ['py_test(', f'    name = "{n}",', f'    srcs = ["{p}"],',
          f'    size = "{"large" if big else "medium"}",', '    data = ["BUILD"],',
          '    deps = [":training", ":test_support"],', ')', '']
out += ['# The quickstart notebook runs under pytest --nbmake (see README).', 'filegroup(',
        '    name = "notebooks",', '    srcs = glob(["notebooks/*.ipynb"]),', ')', '']
pathlib.Path('BUILD').write_text('\n'.join(out))
