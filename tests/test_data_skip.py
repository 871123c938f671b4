"""The real-data skip of ``conftest.data_dir``: what it checks and says.

Independent expectations: files created here, and the names a user must act
on (the environment variable, each subfolder and file name).
"""

import conftest


def test_unset_variable_misses_every_file_and_names_the_variable():
  missing = conftest.missing_data_files(None)
  expected = [f'{sub}/{name}' for sub, (names, _) in
              conftest.DATA_LAYOUT.items() for name in names]
  assert missing == expected
  assert 'femnist105/federated_emnist_train.sqlite' in missing
  reason = conftest.data_skip_reason(None, missing)
  assert 'FEDLITE_DATA_DIR is not set' in reason
  for sub, name in (('femnist105', 'federated_emnist_test.sqlite'),
                    ('shakespeare', 'shakespeare_train.sqlite'),
                    ('tff_shakespeare_h5', 'shakespeare_test.h5')):
    assert f'{sub}/' in reason and name in reason
  assert '~/.cache/fedjax' in reason
  assert '\n' not in reason


def test_partial_folder_lists_exactly_the_missing_files(tmp_path):
  for sub, (names, _) in conftest.DATA_LAYOUT.items():
    (tmp_path / sub).mkdir()
    for name in names:
      (tmp_path / sub / name).write_bytes(b'')
  assert conftest.missing_data_files(tmp_path) == []
  (tmp_path / 'shakespeare' / 'shakespeare_test.sqlite').unlink()
  missing = conftest.missing_data_files(tmp_path)
  assert missing == ['shakespeare/shakespeare_test.sqlite']
  reason = conftest.data_skip_reason(tmp_path, missing)
  assert f'FEDLITE_DATA_DIR={tmp_path} lacks shakespeare/shakespeare_test.sqlite' in reason
