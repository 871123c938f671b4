#!/usr/bin/env python3
"""Phase 1 of transfer learning: centralized pretraining on another corpus.

Ro et al. (2022), Sec. 5 / App. D: pretrain centrally with Adam (batch 16)
on a corpus other than the federated one, then fine-tune federatedly from
the saved parameters. This script encodes the corpus with the federated
task's SentencePiece model (trained on that task's TRAINING split; created
and cached if needed), trains ``--model`` and writes a parameter file for
phase 2:

  python experiments/pretrain_centralized.py --task=shakespeare \\
      --model=transformer_tiny --corpus=python_help --steps=1500 \\
      --output=runs/pretrain/transformer_tiny_python_help.params

  # phase 2 (federated fine-tuning from the pretrained parameters):
  python experiments/run_experiment.py --task=shakespeare \\
      --tokenizer=sentencepiece --model=transformer_tiny --sequence_length=30 \\
      --init_checkpoint=runs/pretrain/transformer_tiny_python_help.params ...

Corpus 'python_help': CPython's help topics (``pydoc_data.topics``), real
English prose that is not Shakespeare. Metadata (corpus, steps, loss,
seconds, SentencePiece model path) is stored in the file.
"""

import json

from absl import app
from absl import flags

import fedlite_jax  # noqa: F401  (FedJAX compatibility fixes first)
import jax

from fedlite_jax.datasets import sentencepiece_vocab
from fedlite_jax.training import pretrain
from fedlite_jax.training import state_io
from fedlite_jax.models import lm

flags.DEFINE_enum('task', 'shakespeare', sorted(sentencepiece_vocab.SP_TASKS),
                  'Federated task whose SentencePiece vocabulary to use.')
flags.DEFINE_string('data_dir', None, 'Data directory of the task.')
flags.DEFINE_integer('sp_vocab_size', sentencepiece_vocab.DEFAULT_VOCAB_SIZE,
                     'SentencePiece ids (incl. PAD/BOS/EOS/UNK).')
flags.DEFINE_integer('sequence_length', 30, 'Max sequence length.')
flags.DEFINE_enum('model', 'transformer_tiny', list(lm.PRESETS), 'LM preset.')
flags.DEFINE_enum('loss_reduction', 'sequence_sum', list(lm.LOSS_REDUCTIONS),
                  'Per-sequence loss.')
flags.DEFINE_enum('corpus', 'python_help', list(pretrain.CORPORA),
                  'Pretraining corpus.')
flags.DEFINE_integer('steps', 1500, 'Adam steps.', lower_bound=1)
flags.DEFINE_integer('batch_size', 16, 'Batch size (paper: 16).',
                     lower_bound=1)
flags.DEFINE_float('lr', 1e-3, 'Adam learning rate.')
flags.DEFINE_float('clip_norm', 16.0, 'Global-norm clip (0 = off).')
flags.DEFINE_integer('seed', 0, 'Init and shuffling seed.')
flags.DEFINE_string('output', None, 'Parameter file to write.', required=True)

FLAGS = flags.FLAGS


def main(argv):
  del argv
  _, _, info = sentencepiece_vocab.load_sentencepiece_data(
      FLAGS.task, FLAGS.data_dir, sequence_length=FLAGS.sequence_length,
      vocab_size=FLAGS.sp_vocab_size)
  model_path = info.cached_files[-1]
  tokenizer = sentencepiece_vocab.load_tokenizer(model_path)
  texts = pretrain.corpus_texts(FLAGS.corpus)
  data = pretrain.encode_chunks(tokenizer.piece_ids(texts),
                                FLAGS.sequence_length)
  model = lm.create_lm(FLAGS.model, vocab_size=tokenizer.num_ids,
                       max_length=FLAGS.sequence_length,
                       oov_id=tokenizer.oov_id,
                       loss_reduction=FLAGS.loss_reduction).model
  params = model.init(jax.random.PRNGKey(FLAGS.seed))
  params, stats = pretrain.pretrain(
      model, params, data, steps=FLAGS.steps, batch_size=FLAGS.batch_size,
      learning_rate=FLAGS.lr, clip_norm=FLAGS.clip_norm, seed=FLAGS.seed,
      log_every=max(1, FLAGS.steps // 10))
  meta = {'corpus': FLAGS.corpus, 'model': FLAGS.model,
          'task_tokenizer': model_path, 'sequence_length':
              FLAGS.sequence_length, 'lr': FLAGS.lr,
          'clip_norm': FLAGS.clip_norm, 'batch_size': FLAGS.batch_size,
          'seed': FLAGS.seed, **stats}
  state_io.save_params(FLAGS.output, params, meta)
  print(json.dumps(meta, indent=1))


if __name__ == '__main__':
  app.run(main)
