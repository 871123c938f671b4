"""The FEMNIST-105 training setting shared by the DP studies.

``experiments/dp_femnist.py`` and ``experiments/ddp_femnist.py`` train the
setting of ``configs/igc_femnist_static.flags`` (batch 20, client SGD 0.3,
server SGD, one-step rounds, evaluation on every test example); each adds
its own clients per round and server learning rate. The row flags of the
two models they compare are here too, so both studies run the same models.
"""

from __future__ import annotations

INTRINSIC_DIM = 4096
#: run_experiment.py flags of the training setting (without
#: --clients_per_round and --server_lr).
TRAIN = ('--task=emnist', '--client_batch_size=20', '--client_optimizer=sgd',
         '--client_lr=0.3', '--server_optimizer=sgd', '--eval_num_clients=0')
#: The full CNN, FedAvg with one local step.
FULL = ('--algorithm=fedavg', '--local_steps=1')
#: IGC static, d = 4,096.
IGC = ('--algorithm=igc_static', f'--intrinsic_dim={INTRINSIC_DIM}',
       '--igc_scale=unit_expectation')
IGC_LABEL = f'IGC static, d = {INTRINSIC_DIM:,}'
