"""Tests for the numpy word pipeline, token counts and Shakespeare tokens.

Expected arrays are written out by hand from FedJAX's documented layout
(fedjax.datasets.stackoverflow.DefaultWordTokenizer: PAD 0, BOS 1, EOS 2,
words from 3, OOV after the vocabulary; x = ids[:-1], y = ids[1:], padded /
truncated to max_length) and TFF's tag-prediction ``to_ids``.
"""

import fedlite_jax  # noqa: F401  (applies FedJAX fixes; import before fedjax)
import fedjax  # pylint: disable=g-bad-import-order
import numpy as np
import pytest

from fedlite_jax import datasets
from fedlite_jax.datasets import vocab


def _bytes_array(values):
  out = np.empty(len(values), dtype=object)
  out[:] = values
  return out


def test_word_tokenizer_hand_computed():
  # the=3, cat=4, sat=5, OOV=6 (vocab_size 3 -> 7 ids).
  tok = datasets.WordTokenizer(['the', b'cat', b'sat'])
  assert (tok.oov_id, tok.num_ids) == (6, 7)
  tokens = _bytes_array([
      b'the cat sat on the mat',  # 6 words > L: truncated, no EOS in y.
      b'cat',  # Short: BOS/EOS and PAD.
      b'the cat sat',  # L - 1 words: EOS is y's last entry.
      b'the cat sat the',  # Exactly L words: y has no EOS.
      b'sat  cat',  # Double space: an empty word, which is OOV.
      b'',  # Empty post: one empty word (tf.strings.split semantics).
  ])
  x, y = tok.encode(tokens, max_length=4)
  assert x.dtype == np.int32 and y.dtype == np.int32
  np.testing.assert_array_equal(x, [
      [1, 3, 4, 5],
      [1, 4, 0, 0],
      [1, 3, 4, 5],
      [1, 3, 4, 5],
      [1, 5, 6, 4],
      [1, 6, 0, 0],
  ])
  np.testing.assert_array_equal(y, [
      [3, 4, 5, 6],
      [4, 2, 0, 0],
      [3, 4, 5, 2],
      [3, 4, 5, 3],
      [5, 6, 4, 2],
      [6, 2, 0, 0],
  ])


def test_word_tokenizer_reserved_vocab_slots_and_preprocess_batch():
  # A requested vocab_size larger than the words available keeps FedJAX's
  # layout: OOV = vocab_size + 3.
  tok = datasets.WordTokenizer([b'a', b'b'], vocab_size=10)
  assert (tok.oov_id, tok.num_ids) == (13, 14)
  fn = tok.as_preprocess_batch(3)
  out = fn({'tokens': _bytes_array([b'b zz a', b'a']),
            'domain_id': np.array([0, 1], np.int32)})
  assert set(out) == {'x', 'y', 'domain_id'}
  np.testing.assert_array_equal(out['x'], [[1, 4, 13], [1, 3, 0]])
  np.testing.assert_array_equal(out['y'], [[4, 13, 3], [3, 2, 0]])
  np.testing.assert_array_equal(out['domain_id'], [0, 1])
  with pytest.raises(ValueError, match='duplicate'):
    datasets.WordTokenizer([b'a', 'a'])
  with pytest.raises(ValueError, match='smaller than the vocabulary'):
    datasets.WordTokenizer([b'a', b'b'], vocab_size=1)
  with pytest.raises(ValueError, match='max_length'):
    tok.as_preprocess_batch(0)


def test_tag_prediction_encoder_hand_computed():
  enc = datasets.TagPredictionEncoder([b'a', b'b'], [b'x', b'y'],
                                      num_words=3, num_tags=2)
  x, y = enc.encode(
      _bytes_array([b'a b a c', b'', b'b']),
      _bytes_array([b'b', b'', b'zz  b']),
      _bytes_array([b'y|z', b'x', b'x|y']))
  # Row 0: words a b a c b (5, c is OOV) -> a 2/5, b 2/5.
  # Row 1: no words -> zeros. Row 2: words b zz b -> b 2/3.
  np.testing.assert_allclose(x, [[0.4, 0.4, 0.0], [0, 0, 0], [0, 2 / 3, 0]],
                             rtol=1e-6)
  np.testing.assert_array_equal(y, [[0, 1], [1, 0], [1, 1]])
  assert x.dtype == np.float32 and y.dtype == np.float32


def _fd(clients):
  return fedjax.InMemoryFederatedData(
      {cid: {'tokens': _bytes_array(v)} for cid, v in clients.items()})


def test_token_counts_and_rankings(tmp_path):
  fd = _fd({b'A': [b'q q q q', b'y z'], b'B': [b'r'], b'C': [b'r b']})
  counts = vocab.count_tokens(fd, 'tokens', b' ')
  # Occurrences: q 4, r 2, then b, y, z once each (ties by bytes).
  assert counts.tokens == (b'q', b'r', b'b', b'y', b'z')
  np.testing.assert_array_equal(counts.occurrences, [4, 2, 1, 1, 1])
  np.testing.assert_array_equal(counts.clients, [1, 2, 1, 1, 1])
  assert (counts.num_clients, counts.num_examples) == (3, 4)
  assert counts.top(2) == [b'q', b'r']
  assert counts.top(2, by='clients') == [b'r', b'b']
  assert counts.top(99) == list(counts.tokens)
  with pytest.raises(ValueError, match='vocab_ranking'):
    counts.top(2, by='tfidf')

  path = str(tmp_path / 'counts.msgpack')
  vocab.save(counts, path)
  loaded = vocab.load(path)
  assert loaded.tokens == counts.tokens
  np.testing.assert_array_equal(loaded.clients, counts.clients)


def test_cached_token_counts_reuses_file(tmp_path, monkeypatch):
  src = tmp_path / 'source.bin'
  src.write_bytes(b'x')
  fd = _fd({b'A': [b'a b']})
  first, path = vocab.cached_token_counts(fd, 'tokens', b' ', 'demo',
                                          [str(src)], 'v', tmp_path / 'c')
  monkeypatch.setattr(vocab, 'count_tokens',
                      lambda *a: pytest.fail('recounted despite cache'))
  second, path2 = vocab.cached_token_counts(fd, 'tokens', b' ', 'demo',
                                            [str(src)], 'v', tmp_path / 'c')
  assert path == path2 and second.tokens == first.tokens == (b'a', b'b')


@pytest.mark.parametrize('text, expected', [
    (b"Is 'old dog' my reward? Most true,",
     b"is ' old dog ' my reward ? most true ,"),
    (b"The thrifty hire I sav'd under your father,\nWhich I did store",
     b"the thrifty hire i sav'd under your father , which i did store"),
    (b'Your brother- no, no brother; four-score', 
     b'your brother - no , no brother ; four-score'),
    (b'[Within.] I do_beseech', b'[ within . ] i do _ beseech'),
    (b'   ', b''),
])
def test_words_from_text(text, expected):
  assert datasets.words_from_text(text) == expected
