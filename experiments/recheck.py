"""Re-records the ``check`` of results files: their check run, at HEAD.

Each results file keeps a ``check``: one short run of a configuration it
reports, with its evaluation curve, which ``tests/test_experiment_results.py``
re-runs at HEAD and compares within the check's tolerance. When a change
moves those numbers within float noise, this re-runs each check's own command and
writes the new curve, commit and dirty flag back, leaving every other
entry of the file as it was (the check's ``spread`` and ``tolerance`` from
``experiments/measure_check_spread.py`` included)::

  python experiments/recheck.py --files=igc_femnist.json,lm_seeds.json

Files whose check is a script's own (``igc_privacy.json``: ``--check``)
are re-recorded by that script.
"""

from __future__ import annotations

import json
import pathlib
import shlex

from absl import app
from absl import flags

import provenance

FLAGS = flags.FLAGS
flags.DEFINE_list('files', ['efficient_lm.json', 'fedlite_convergence.json',
                            'fedlite_results.json', 'igc_femnist.json',
                            'igc_seeds.json', 'lm_seeds.json'],
                  'Results files under experiments/results/ to re-check.')


def recheck(path: pathlib.Path) -> dict:
  """Re-runs ``path``'s check command; writes and returns the new check."""
  data = json.loads(path.read_text())
  old = data.get('check')
  if not old or 'curve' not in old:
    raise app.UsageError(f'{path.name} has no runner check (a "check" with '
                         'a "curve"); its own script re-records it.')
  argv = shlex.split(old['command'])
  if argv[:2] != ['python', provenance.RUNNER]:
    raise app.UsageError(f'{path.name}: check command {old["command"]!r} is '
                         f'not a {provenance.RUNNER} run.')
  flags_ = [f for f in argv[2:] if f not in ('--noresume', '--overwrite')]
  data['check'] = provenance.check_record(flags_, old['label'])
  # The measured float-order spread and the tolerance it sets stay: they
  # describe the configuration, not one recording; re-measure them with
  # experiments/measure_check_spread.py when the run's programs change.
  data['check'].update({k: old[k] for k in ('spread', 'tolerance')
                        if k in old})
  path.write_text(json.dumps(data, indent=1) + '\n')
  return data['check']


def main(argv):
  del argv
  for name in FLAGS.files:
    check = recheck(provenance.REPO / provenance.RESULTS_DIR / name)
    print(f'{name}: {check["curve"][-1]} at {check["commit"][:12]}'
          f'{" (dirty)" if check["dirty"] else ""}', flush=True)


if __name__ == '__main__':
  app.run(main)
