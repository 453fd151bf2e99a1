"""The result store: where sealed shards live, a local directory or an fsspec URL.

A shard of run R, partition P is ``<store>/R/P/<shard>.parquet``; the specs of its jobs (what
``tokenmill repair`` generates them again from) are ``<store>/R/P/_specs/<shard>.parquet``
(dataset readers skip ``_``-prefixed directories and ``.``-prefixed files). A file is written
whole or not at all: on a local disk to a temporary ``.``-name in the same directory, fsynced,
renamed, and the directory fsynced; on object storage (S3, GCS, Azure) with one PUT, which is
never visible half-written; on any other fsspec filesystem to a temporary name, then moved.
Credentials come from the store's usual environment (``AWS_*`` for S3, and so on).
"""

from __future__ import annotations

import io
import os
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import IO, Any

import fsspec

from tokenmill.errors import ResultStoreError
from tokenmill.url_secrets import redact_url

OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "memory"})
SPECS_DIR = "_specs"
Hook = Callable[[str], None]


def no_hook(step: str) -> None:
    """The default hook: does nothing."""


class ResultStore:
    """One result store; ``url`` is what the ledger records for a run (local: an absolute path)."""

    def __init__(self, url: str) -> None:
        raw = url.strip()
        if not raw:
            raise ResultStoreError("the result store URL is empty (set TOKENMILL_RESULTS_URL)")
        self.local = "://" not in raw or raw.startswith("file://")
        try:
            if self.local:
                path = os.path.abspath(os.path.expanduser(raw.removeprefix("file://")))
                self.fs: Any = fsspec.filesystem("file")
                self.root = path
                self.url = path
            else:
                self.fs, root = fsspec.core.url_to_fs(raw)
                self.root = root.rstrip("/")
                self.url = raw.rstrip("/")
        except (ImportError, ValueError) as exc:
            raise ResultStoreError(f"result store {redact_url(raw)!r} cannot be opened: {exc}") from None
        self.shown = redact_url(self.url)  # the URL in messages: credentials hidden
        protocol = self.fs.protocol
        self.protocols = {protocol} if isinstance(protocol, str) else set(protocol)

    def __repr__(self) -> str:
        return f"ResultStore({self.shown!r})"

    # -- paths ------------------------------------------------------------------------------

    def path(self, *parts: str) -> str:
        """A path under the store's root (``tokenmill api`` keeps its files under ``_api``)."""
        return os.path.join(self.root, *parts) if self.local else "/".join((self.root, *parts))

    def shard_path(self, run: str, partition: str, shard_id: str) -> str:
        return self.path(run, partition, f"{shard_id}.parquet")

    def specs_path(self, run: str, partition: str, shard_id: str) -> str:
        return self.path(run, partition, SPECS_DIR, f"{shard_id}.parquet")

    def describe(self, path: str) -> str:
        """``path`` as a user can find it (with the store's scheme for remote stores)."""
        if self.local:
            return path
        scheme = self.url.split("://", 1)[0]
        return redact_url(f"{scheme}://{path}")

    # -- writing ----------------------------------------------------------------------------

    def write(self, path: str, data: bytes, hook: Hook = no_hook) -> None:
        """Write ``data`` at ``path``, whole or not at all; ``hook("tmp_written")`` runs once a
        temporary copy is durable and before it takes the final name (a test fault point)."""
        if self.local:
            with self.writer(path, hook) as fh:
                fh.write(data)
            return
        try:
            if self.protocols & OBJECT_STORES:
                self.fs.pipe_file(path, data)
            else:
                tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp"
                self.fs.pipe_file(tmp, data)
                hook("tmp_written")
                self.fs.mv(tmp, path)
        except OSError as exc:
            raise ResultStoreError(f"cannot write {self.describe(path)}: {exc}") from exc

    @contextmanager
    def writer(self, path: str, hook: Hook = no_hook) -> Iterator[IO[bytes]]:
        """A binary file that writes ``path`` piece by piece, whole or not at all as
        :meth:`write` does: on a local disk through a fsynced temporary name (``hook`` as
        :meth:`write`'s), on object storage as one multipart upload (aborted on an error),
        elsewhere through a temporary name."""
        direct = not self.local and bool(self.protocols & OBJECT_STORES)
        if self.local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        folder, name = path.rsplit("/", 1) if not self.local else os.path.split(path)
        tmp = path if direct else f"{folder}/.{name}.{uuid.uuid4().hex[:8]}.tmp"
        try:
            fh = self.fs.open(tmp, "wb")
            try:
                yield fh
                if self.local:
                    fh.flush()
                    os.fsync(fh.fileno())
                    hook("tmp_written")
            except BaseException:
                discard = getattr(fh, "discard", None)
                discard() if direct and discard else fh.close()
                if not direct:
                    self.fs.rm_file(tmp)
                raise
            fh.close()
            if not direct:
                self.fs.mv(tmp, path)
            if self.local:
                fd = os.open(folder, os.O_RDONLY)
                try:
                    os.fsync(fd)  # the rename itself survives a power cut
                finally:
                    os.close(fd)
        except OSError as exc:
            raise ResultStoreError(f"cannot write {self.describe(path)}: {exc}") from exc

    def reader(self, path: str) -> IO[bytes]:
        """``path`` opened for reading in order, streamed through a 1 MiB buffer (fsspec's own
        ``readline`` reads a block per line); a missing file raises ``FileNotFoundError``."""
        if self.local:
            return open(path, "rb", buffering=1 << 20)
        return io.BufferedReader(self.fs.open(path, "rb", cache_type="none"), 1 << 20)

    def remove(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm_file(path)

    def remove_temporaries(self, run: str, partition: str, shard_id: str) -> int:
        """Delete what a sealer that died left of ``shard_id``'s temporary files; returns how many."""
        removed = 0
        for final in (self.shard_path(run, partition, shard_id), self.specs_path(run, partition, shard_id)):
            if self.local:
                folder, name = os.path.split(final)
                pattern = os.path.join(folder, f".{name}.*.tmp")
            elif self.protocols & OBJECT_STORES:
                continue  # one PUT: nothing temporary
            else:
                pattern = f"{final}.*.tmp"
            for tmp in self.fs.glob(pattern):
                self.fs.rm_file(tmp)
                removed += 1
        return removed

    # -- reading and removing ---------------------------------------------------------------

    @contextmanager
    def open(self, path: str) -> Iterator[str | IO[bytes]]:
        """Something pyarrow reads ``path`` from: the path itself for a local store (pyarrow's
        own I/O), else a seekable fsspec file. A missing file raises ``FileNotFoundError``."""
        if self.local:
            if not os.path.exists(path):
                raise FileNotFoundError(path)
            yield path
            return
        # no read-ahead cache: pyarrow reads the footer and whole column chunks itself, and an
        # export keeps several shards open at once
        with self.fs.open(path, "rb", cache_type="none") as fh:
            yield fh

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def delete_run(self, run: str) -> int:
        """Remove every file of ``run``; returns how many there were."""
        folder = self.path(run)
        try:
            if not self.fs.exists(folder):
                return 0
            files = self.fs.find(folder)
            self.fs.rm(folder, recursive=True)
        except OSError as exc:
            raise ResultStoreError(f"cannot delete {self.describe(folder)}: {exc}") from exc
        return len(files)
