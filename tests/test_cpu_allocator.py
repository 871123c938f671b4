"""fedlite_jax.cpu_allocator: XLA:CPU's buffers without a fault per 4 KiB.

Each case runs in a fresh Python process: glibc is set before JAX starts
its CPU threads (tuned) or when the process starts (huge pages). The
expectation is a page count: a 64 MiB output is 16,384 pages of 4 KiB,
which glibc's defaults fault in at every call (a fresh mmap), the tuned
heap reuses, and huge pages fault in as 32 pages of 2 MiB: the fewest
faults of 20 calls.
"""

import json
import os
import platform
import subprocess
import sys
import textwrap

import conftest
import jax
import pytest

from fedlite_jax import cpu_allocator

_PAGES = 2**26 // 4096  # pages of the 64 MiB output

_FAULTS = textwrap.dedent("""
    import resource
    import fedlite_jax
    from fedlite_jax import cpu_allocator
    import jax, jax.numpy as jnp
    double = jax.jit(lambda x: x * 2)
    x = jnp.ones(2**24, jnp.float32)  # 64 MiB
    faults = []
    for _ in range(20):
      before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      double(x).block_until_ready()
      faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                    - before)
    print(cpu_allocator.STATE)
    print(min(faults))  # the heap grows over the first calls
""")


def _run(code: str, **env: str) -> subprocess.CompletedProcess:
  full = {k: v for k, v in os.environ.items()
          if k not in (cpu_allocator.ENV, 'GLIBC_TUNABLES')}
  full.update(env)
  return subprocess.run([sys.executable, '-c', code], env=full,
                        capture_output=True, text=True, timeout=300)


_GLIBC = pytest.mark.skipif(
    platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc',
    reason='the settings are glibc\'s (Linux)')
_THP = pytest.mark.skipif(
    cpu_allocator.thp_mode() != 'madvise'
    or cpu_allocator.glibc_version() < (2, 35),
    reason=f'huge pages on request need the kernel\'s transparent huge pages '
           f'in madvise mode (here {cpu_allocator.thp_mode()!r}) and glibc '
           f'>= 2.35 (here {cpu_allocator.glibc_version()})')


@_GLIBC
def test_tuned_allocator_reuses_xla_cpu_buffers():
  tuned = _run(_FAULTS, **{cpu_allocator.ENV: 'tuned'})
  system = _run(_FAULTS, **{cpu_allocator.ENV: 'system'})
  assert tuned.returncode == 0, tuned.stderr[-2000:]
  assert system.returncode == 0, system.stderr[-2000:]
  state, faults = tuned.stdout.strip().split('\n')
  assert state.startswith('tuned')
  assert float(faults) < 0.05 * _PAGES
  state, faults = system.stdout.strip().split('\n')
  assert state == 'system: default'
  # glibc's defaults fault the fresh 64 MiB output in at every call.
  assert float(faults) > 0.9 * _PAGES


@_THP
def test_huge_pages_fault_in_2_mib_at_a_time():
  out = _run(_FAULTS, GLIBC_TUNABLES=cpu_allocator.HUGE_PAGES_TUNABLE)
  assert out.returncode == 0, out.stderr[-2000:]
  state, faults = out.stdout.strip().split('\n')
  assert state == 'system: default, huge pages'
  assert float(faults) < 0.05 * _PAGES  # 32 huge pages, not 16,384


def test_restart_env_adds_the_tunable_only_where_it_helps():
  env = {'PATH': '/bin'}
  got = cpu_allocator.restart_env(env, 'madvise', (2, 36))
  assert got == {'PATH': '/bin', 'GLIBC_TUNABLES': 'glibc.malloc.hugetlb=1'}
  got = cpu_allocator.restart_env(
      {'GLIBC_TUNABLES': 'glibc.malloc.arena_max=2'}, 'madvise', (2, 35))
  assert got == {'GLIBC_TUNABLES':
                 'glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1'}
  for environ, thp, glibc in (
      (env, 'always', (2, 36)),  # the kernel gives them unasked
      (env, 'never', (2, 36)),
      (env, '', (2, 36)),
      (env, 'madvise', (2, 34)),  # glibc without the tunable
      (env, 'madvise', ()),  # another C library
      ({'GLIBC_TUNABLES': 'glibc.malloc.hugetlb=0'}, 'madvise', (2, 36)),
      ({cpu_allocator.HUGE_PAGES_ENV: '0'}, 'madvise', (2, 36))):
    assert cpu_allocator.restart_env(environ, thp, glibc) is None, (
        environ, thp, glibc)


@_THP
def test_restart_keeps_the_process_and_its_arguments():
  code = textwrap.dedent("""
      import os, sys
      print('start', os.getpid(), os.environ.get('GLIBC_TUNABLES'),
            sys.argv[1:], flush=True)
      from fedlite_jax import cpu_allocator
      cpu_allocator.restart_with_huge_pages()
      print('after', os.getpid(), cpu_allocator.STATE)
  """)
  out = subprocess.run(
      [sys.executable, '-u', '-c', code, 'a', '--b=c'], capture_output=True,
      text=True, timeout=300,
      env={k: v for k, v in os.environ.items()
           if k not in ('GLIBC_TUNABLES', cpu_allocator.ENV)})
  assert out.returncode == 0, out.stderr[-2000:]
  lines = out.stdout.strip().split('\n')
  pid = lines[0].split()[1]
  assert lines == [f"start {pid} None ['a', '--b=c']",
                   f"start {pid} glibc.malloc.hugetlb=1 ['a', '--b=c']",
                   f'after {pid} system: default, huge pages'], lines


@pytest.mark.parametrize('backend,restarts', [('cpu', True), ('gpu', False),
                                               ('tpu', False)])
def test_restart_only_where_the_backend_is_the_cpu(monkeypatch, backend,
                                                   restarts):
  # GPU/TPU buffers do not come from glibc: no restart (a few seconds of a
  # device's time) there, whatever the host's glibc and kernel.
  calls = []
  monkeypatch.delenv('GLIBC_TUNABLES', raising=False)
  monkeypatch.delenv(cpu_allocator.HUGE_PAGES_ENV, raising=False)
  monkeypatch.setattr(cpu_allocator, 'thp_mode', lambda: 'madvise')
  monkeypatch.setattr(cpu_allocator, 'glibc_version', lambda: (2, 36))
  monkeypatch.setattr(jax, 'default_backend', lambda: backend)
  monkeypatch.setattr(os, 'execve', lambda *args: calls.append(args))
  cpu_allocator.restart_with_huge_pages()
  assert len(calls) == (1 if restarts else 0), calls
  if restarts:
    assert calls[0][2]['GLIBC_TUNABLES'] == cpu_allocator.HUGE_PAGES_TUNABLE


def test_late_configure_says_it_cannot_tune():
  out = _run('import fedlite_jax, jax\njax.numpy.ones(2).block_until_ready()\n'
             'from fedlite_jax import cpu_allocator\n'
             "print(cpu_allocator.configure('tuned'))")
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip().startswith(
      'system: JAX had already started its CPU threads')
  assert 'CPU allocator not tuned' in out.stderr


def test_unknown_mode_is_one_line_naming_it():
  out = _run('import fedlite_jax', **{cpu_allocator.ENV: 'fast'})
  assert out.returncode != 0
  assert out.stderr.strip().splitlines()[-1] == (
      "ValueError: FEDLITE_CPU_ALLOCATOR='fast' is not a CPU allocator mode; "
      'use one of system, tuned.')
  with pytest.raises(ValueError, match="'fast' is not a CPU allocator mode"):
    cpu_allocator.configure('fast')


def test_bench_cpu_allocator_rows(tmp_path):
  with conftest.benchmark_modules('bench_cpu_allocator') as (bench,):
    out = tmp_path / 'alloc.md'
    rows = bench.main(['--model=transformer_tiny', '--kinds=vmap',
                       '--lanes=2', '--repeats=2', '--engines=loop',
                       '--rounds=2', '--runs=1', f'--output={out}'])
  assert [r['what'] for r in rows] == [
      'transformer_tiny vmap (2 lanes), ms per step',
      'runner, loop engine, s/round']
  for r in rows:
    assert r['system'] > 0 and r['tuned'] > 0, r
  assert rows[1]['same'] == 'yes', rows  # the allocator changes no result
  text = out.read_text()
  assert f'--output={out}`' in text and '| yes |' in text


@_THP
@pytest.mark.parametrize('engine', ['vmap', 'loop'])
def test_binary_restarts_with_huge_pages_for_the_vmap_engine(
    engine, repo_root, tmp_path):
  env = {k: v for k, v in os.environ.items()
         if k not in ('GLIBC_TUNABLES', cpu_allocator.ENV,
                      'FEDLITE_DATA_DIR')}
  out = subprocess.run(
      [sys.executable, str(repo_root / 'experiments' / 'run_experiment.py'),
       '--num_rounds=1', '--clients_per_round=4', f'--round_engine={engine}',
       f'--output_dir={tmp_path}/run', '--noprogress'],
      cwd=repo_root, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  summary = json.loads((tmp_path / 'run' / 'summary.json').read_text())
  assert summary['engine']['cpu_allocator'] == (
      'system: default, huge pages' if engine == 'vmap' else
      'system: default')
