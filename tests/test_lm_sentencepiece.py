"""SentencePiece pipeline: determinism, id layout, caching, bad input.

Real data: the Shakespeare training snippets in FEDLITE_DATA_DIR.
"""

import os

import fedlite_jax  # noqa: F401
import numpy as np
import pytest
import sentencepiece as spm

from fedlite_jax.datasets import sentencepiece_vocab as sv
from fedlite_jax.datasets import shakespeare


@pytest.fixture(scope='module')
def train_lines(data_dir):
  train, _, _ = shakespeare.load_snippets(str(data_dir))
  return list(sv.split_sentences(train, 'snippets', split_lines=True))


@pytest.fixture(scope='module')
def sp_data(data_dir, tmp_path_factory):
  cache = tmp_path_factory.mktemp('spcache')
  train, test, info = sv.load_shakespeare_sp(str(data_dir), cache_dir=cache)
  return train, test, info, cache


def test_training_is_deterministic(train_lines):
  config = sv.SentencePieceConfig(vocab_size=600, input_sentence_size=3000)
  a = sv.train_sentencepiece(train_lines[:8000], config)
  b = sv.train_sentencepiece(train_lines[:8000], config)
  assert a == b
  c = sv.train_sentencepiece(train_lines[:8000],
                             sv.SentencePieceConfig(vocab_size=600,
                                                    input_sentence_size=3000,
                                                    seed=1))
  tok_a, tok_c = sv.SubwordTokenizer(a), sv.SubwordTokenizer(c)
  assert tok_a.num_ids == tok_c.num_ids == 600


def test_loader_ids_lengths_and_cache(sp_data):
  train, test, info, cache = sp_data
  assert info.num_classes == 4096
  assert info.vocab_size == 4092 and info.oov_id == sv.UNK_ID == 3
  assert info.sequence_length == 30 and info.input_shape == (30,)
  assert info.num_train_clients == 715
  model_path = info.cached_files[-1]
  assert model_path.startswith(str(cache)) and model_path.endswith('.model')
  tok = sv.load_tokenizer(model_path)
  assert [tok._sp.id_to_piece(i) for i in range(4)] == [
      '<pad>', '<s>', '</s>', '<unk>']
  n_full = n = 0
  for _, cds in list(train.clients())[:60]:
    ex = cds.all_examples()
    x, y = ex['x'], ex['y']
    assert x.dtype == y.dtype == np.int32 and x.shape[1] == y.shape[1] == 30
    assert (x[:, 0] == sv.BOS_ID).all()
    assert x.min() >= 0 and x.max() < 4096 and y.max() < 4096
    # y is x shifted by one; EOS only if the snippet fits.
    np.testing.assert_array_equal(x[:, 1:][x[:, 1:] != 0],
                                  y[:, :-1][x[:, 1:] != 0])
    for row in y:
      body = row[row != 0]
      if len(body) < 30:
        assert body[-1] == sv.EOS_ID and (row[len(body):] == 0).all()
      else:
        n_full += 1
    n += len(y)
  assert 0 < n_full < n  # both truncated and complete snippets occur
  # The cached model is reused: same bytes, file untouched.
  mtime = os.stat(model_path).st_mtime_ns
  _, _, info2 = sv.load_shakespeare_sp(None, cache_dir=cache)
  assert info2.cached_files[-1] == model_path
  assert os.stat(model_path).st_mtime_ns == mtime


def test_encode_and_decode_roundtrip(sp_data):
  _, _, info, _ = sp_data
  tok = sv.load_tokenizer(info.cached_files[-1])
  text = b'Yonder comes my master,\n  your brother.'
  x, y = tok.encode([text, b''], 30)
  ids = tok.piece_ids([text])[0]
  assert list(x[0, :len(ids) + 1]) == [sv.BOS_ID] + ids
  assert list(y[0, :len(ids) + 1]) == ids + [sv.EOS_ID]
  assert tok.decode(y[0]) == 'Yonder comes my master, your brother.'
  assert list(x[1]) == [sv.BOS_ID] + [0] * 29  # empty text: BOS -> EOS
  assert list(y[1]) == [sv.EOS_ID] + [0] * 29
  x, y = tok.encode([text], 3)
  assert list(x[0]) == [sv.BOS_ID] + ids[:2] and list(y[0]) == ids[:3]


def test_bad_input_raises(train_lines, tmp_path):
  with pytest.raises(ValueError, match='vocab_size=4096'):
    sv.train_sentencepiece(train_lines[:30], sv.SentencePieceConfig())
  with pytest.raises(ValueError, match='empty corpus'):
    sv.train_sentencepiece(['', '  '], sv.SentencePieceConfig())
  for bad in (dict(vocab_size=4), dict(model_type='char'),
              dict(character_coverage=0.0), dict(input_sentence_size=-1)):
    with pytest.raises(ValueError):
      sv.SentencePieceConfig(**bad).validate()
  with pytest.raises(ValueError, match='sequence_length'):
    sv.load_shakespeare_sp(None, sequence_length=0, cache_dir=tmp_path)
  with pytest.raises(ValueError, match='supports tasks'):
    sv.load_sentencepiece_data('emnist')
  # A model with SentencePiece's default ids (unk 0, bos 1, eos 2) is
  # rejected: this pipeline needs PAD 0.
  import io
  out = io.BytesIO()
  spm.SentencePieceTrainer.train(sentence_iterator=iter(train_lines[:3000]),
                                 model_writer=out, vocab_size=300,
                                 minloglevel=2, num_threads=1)
  with pytest.raises(ValueError, match='ids'):
    sv.SubwordTokenizer(out.getvalue())
  with pytest.raises(ValueError, match='proto'):
    sv.SubwordTokenizer(b'garbage')
