"""A cheap integrity check of SQLite files (their 100-byte header).

Source: SQLite file format, section 1.3 "The Database Header"
(https://www.sqlite.org/fileformat.html).
"""

from __future__ import annotations

import os

from fedlite_jax.datasets.errors import DatasetFormatError

MAGIC = b'SQLite format 3\x00'
HEADER_BYTES = 100


def check_sqlite_file(path: str | os.PathLike[str]) -> None:
  """Checks that ``path`` starts like a complete SQLite database.

  Reads the magic string, page size (offset 16, 2 bytes big-endian, 1 means
  65,536) and page count (offset 28, 4 bytes; valid when the change counters
  at offsets 24 and 92 agree).

  Raises:
    DatasetFormatError (a ValueError): no SQLite header, or fewer bytes than
      the header's pages (truncated); the message names the file.
    OSError: the file cannot be opened.
  """
  path = os.fspath(path)
  size = os.path.getsize(path)
  with open(path, 'rb') as f:
    header = f.read(HEADER_BYTES)
  if len(header) < HEADER_BYTES or not header.startswith(MAGIC):
    raise DatasetFormatError(f'{path} is not an SQLite database (no SQLite '
                             f'header in its {size} bytes).')
  page_size = int.from_bytes(header[16:18], 'big')
  page_size = 65536 if page_size == 1 else page_size
  pages = int.from_bytes(header[28:32], 'big')
  if pages and header[24:28] == header[92:96] and pages * page_size > size:
    raise DatasetFormatError(
        f'{path} is truncated: its SQLite header declares {pages} pages of '
        f'{page_size} bytes ({pages * page_size} bytes), the file has {size} '
        'bytes.')
