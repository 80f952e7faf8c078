"""Reading TOML and writing files atomically, for every file vllm-wa reads or writes.

``atomic_write`` is the only way vllm-wa replaces a file (checkpoints, trace
caches, synthetic traces): readers, and a process that restarts after a
crash, see the old file or the new one, never a partial one.
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import os
import threading
import tomllib
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

TOMLDecodeError = tomllib.TOMLDecodeError
# What a damaged compressed file (one cut short, or not what its name says)
# or a non-UTF-8 one raises while it is read through :func:`opener_for`.
READ_ERRORS = (OSError, EOFError, lzma.LZMAError, zlib.error, UnicodeDecodeError)


def read_bytes(path: str, error: type[Exception], what: str) -> bytes:
    """A file's bytes, read once (a pipe gives them only once); ``error`` names
    ``what`` could not be read."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e}") from e


def read_toml(path: str) -> dict[str, Any]:
    """Parse a TOML file; raises ``OSError`` or what :func:`parse_toml` raises."""
    with open(path, "rb") as f:
        return parse_toml(f.read())


def parse_toml(data: bytes) -> dict[str, Any]:
    """Parse a TOML file's bytes; raises :data:`TOMLDecodeError` (bytes that are
    not UTF-8 too: ``tomllib`` would raise ``UnicodeDecodeError``)."""
    try:
        text = data.decode()
    except UnicodeDecodeError as e:
        raise TOMLDecodeError(f"not UTF-8 text: {e}") from None
    return tomllib.loads(text)


def check_writable(path: str) -> None:
    """Raise ``ValueError`` saying why ``path`` could not be written (before a long run, not after it)."""
    if os.path.isdir(path) or path.endswith(os.sep):
        raise ValueError(f"cannot write {path}: it names a directory, not a file")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"cannot write {path}: {folder} is not a writable directory")


def opener_for(path: str) -> Callable[..., IO[Any]]:
    """``open``, or the compressed look-alike the file's name says (.gz, .xz, .bz2)."""
    for suffix, opener in ((".gz", gzip.open), (".xz", lzma.open), (".bz2", bz2.open)):
        if path.endswith(suffix):
            return opener
    return open


# What gzip, xz and bzip2 files start with, for one whose name does not say.
_MAGIC_OPENERS: tuple[tuple[bytes, Callable[..., IO[Any]]], ...] = (
    (b"\x1f\x8b", gzip.open), (b"\xfd7zXZ\x00", lzma.open), (b"BZh", bz2.open),
)


def reader_for(path: str, head: bytes | None = None) -> Callable[..., IO[Any]]:
    """:func:`opener_for` for reading: where the name does not say, the file's
    first bytes (``head``, read here when not given) do (a gzipped trace saved
    as ``trace.jsonl`` was 'not a JSON record')."""
    opener = opener_for(path)
    if opener is not open:
        return opener
    if head is None:
        head = read_head(path, 6)
    return next((op for magic, op in _MAGIC_OPENERS if head.startswith(magic)), open)


def read_head(path: str, n: int) -> bytes:
    """The first ``n`` bytes of a file (fewer, or none when it cannot be read: its opener says why)."""
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError:
        return b""


@contextmanager
def atomic_write(
    path: str, mode: str = "w", *, opener: Callable[..., IO[Any]] = open, durable: bool = True, **kwargs: Any
) -> Iterator[IO[Any]]:
    """Yield a file to write ``path``'s new content into; rename it into place on success.

    The temporary file sits beside ``path`` (same file system, so the rename
    is atomic) and is flushed to disk before the rename.  On any error it is
    removed and the error propagates; ``path`` is left as it was.
    ``opener`` is ``open`` or a look-alike (``gzip.open``).  ``durable=False``
    skips the flush to disk, for files nobody needs after a crash (the rename
    still makes the replacement atomic for readers).
    """
    tmp = f"{path}.tmp{os.getpid()}-{threading.get_ident()}"
    try:
        with opener(tmp, mode, **kwargs) as f:
            yield f
        if durable:
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            try:
                os.unlink(tmp)
            except OSError:
                pass
