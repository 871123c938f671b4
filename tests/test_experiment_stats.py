"""experiments/stats.py against hand-computed values."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent /
                       'experiments'))
import stats  # noqa: E402  pylint: disable=g-import-not-at-top


def test_summarize_is_mean_and_sample_std():
  s = stats.summarize([1.0, 2.0, 4.0])
  assert s['n'] == 3 and s['mean'] == pytest.approx(7 / 3)
  # Sample variance: ((4/3)^2 + (1/3)^2 + (5/3)^2) / 2 = 21/9.
  assert s['std'] == pytest.approx((21 / 9) ** 0.5)
  assert stats.summarize([5.0])['std'] == 0.0


def test_tail_mean_averages_the_last_evaluations_that_have_the_key():
  curve = [{'round': 1, 'accuracy': 0.1}, {'round': 2},
           {'round': 3, 'accuracy': 0.3}, {'round': 4, 'accuracy': 0.5},
           {'round': 5, 'accuracy': 0.7}]
  assert stats.tail_mean(curve, 'accuracy') == pytest.approx(0.5)
  assert stats.tail_mean(curve, 'accuracy', k=1) == pytest.approx(0.7)


def test_paired_counts_seeds_agreeing_with_the_mean_sign():
  p = stats.paired({0: 0.6, 1: 0.5, 2: 0.7, 3: 0.2}, {0: 0.5, 1: 0.55, 2: 0.6})
  assert p['seeds'] == [0, 1, 2]
  assert p['diffs'] == pytest.approx([0.1, -0.05, 0.1])
  assert p['mean'] == pytest.approx(0.05) and p['agree'] == 2
  assert stats.paired({0: 1.0}, {0: 1.0})['agree'] == 0
  assert stats.fmt_paired(p, 2, 100) == '+5.00 ± 8.66, same sign in 2/3 seeds'


def test_equal_upload_pairs_the_last_evaluation_with_the_nearest_upload():
  # a uploads 25 per round, b 100: a's 4 rounds match b's first round.
  a = {'runs': [{'seed': s, 'curve': [
      {'round': r, 'upload_bytes': 25.0 * r, 'ppl': 300.0 - r - s}
      for r in (2, 4)]} for s in (0, 1)]}
  b = {'runs': [{'seed': s, 'curve': [
      {'round': r, 'upload_bytes': 100.0 * r, 'ppl': 400.0 - 10 * r}
      for r in (1, 2, 3)]} for s in (1, 0)]}
  p = stats.paired_at_equal_upload(a, b, 'ppl')
  assert p['rounds'] == {0: (4, 1), 1: (4, 1)}
  # a: 296 (seed 0), 295 (seed 1); b at round 1: 390.
  assert p['diffs'] == pytest.approx([-94.0, -95.0])
  assert p['agree'] == 2


@pytest.mark.parametrize('call, message', [
    (lambda: stats.summarize([]), 'values=[]'),
    (lambda: stats.summarize([float('nan')]), 'values=[nan]'),
    (lambda: stats.tail_mean([{'loss': 1.0}], 'accuracy'), "'accuracy'"),
    (lambda: stats.tail_mean([{'a': 1.0}], 'a', k=0), 'k=0'),
    (lambda: stats.paired({0: 1.0}, {1: 1.0}), 'no common seed'),
    (lambda: stats.paired_at_equal_upload(
        {'runs': [{'seed': 3, 'curve': [{'upload_bytes': 1.0, 'p': 1.0}]}]},
        {'runs': [{'seed': 0, 'curve': []}]}, 'p'), 'seed 3 of a has no run'),
])
def test_bad_input_is_one_clear_line(call, message):
  with pytest.raises(ValueError, match=message.replace('[', r'\[').replace(
      ']', r'\]')) as e:
    call()
  assert '\n' not in str(e.value)


def test_eval_rows_keep_evaluations_and_plot_writes_a_png(tmp_path):
  # A training row, an evaluation row as written today, and one as written
  # before one schema (flat metrics, cumulative bytes).
  curve = [{'round': 1, 'train/loss': 2.0, 'comm/upload_bytes': 4.0},
           {'round': 2, 'eval/accuracy': 0.5, 'eval/loss': 1.5,
            'comm/upload_bytes_total': 8.0},
           {'round': 3, 'accuracy': 0.6, 'loss': 1.2, 'upload_bytes': 12.0}]
  assert stats.eval_rows(curve) == [
      {'round': 2, 'accuracy': 0.5, 'loss': 1.5, 'upload_bytes': 8.0},
      {'round': 3, 'accuracy': 0.6, 'loss': 1.2, 'upload_bytes': 12.0}]
  runs = [{'curve': [{'round': 1, 'accuracy': a}, {'round': 2,
                                                  'accuracy': a + 0.1}]}
          for a in (0.2, 0.3, 0.4)]
  stats.plot_seed_bands([{'label': 'row', 'runs': runs}], tmp_path / 'f.png',
                        xlabel='round', title='t')
  assert (tmp_path / 'f.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
