"""A channel's cached objects laid out under a folder by their relative keys: how an entrypoint gets a
channel (``inputs.<name>``, any format) as files, ``TRAINYARD_CHANNEL_<NAME>``. Hard links to the cache,
no copies; nothing written outside the folder, and nothing left in it that the manifest does not list."""

from __future__ import annotations

import errno
from pathlib import Path

from trainyard import s3
from trainyard.errors import DataError, StorageError
from trainyard.home import link_or_copy
from trainyard.listing import ChannelManifest


def mirror(manifest: ChannelManifest, folder: Path) -> Path:
    """Lay a channel's cached objects out under ``folder`` by their relative keys (hard links, no copies).

    Every target is checked to resolve inside ``folder``: nothing is ever written outside it.
    """
    folder = folder.resolve()
    by_rel = {obj.rel: obj for obj in manifest.objects}
    for obj in manifest.objects:
        parts = obj.rel.split("/")
        for above in ("/".join(parts[:n]) for n in range(1, len(parts))):
            if above in by_rel:  # "a" and "a/b": one path cannot be both a file and a folder
                raise DataError(
                    f"{by_rel[above].uri} and {obj.uri}: the first would be laid out as a file where the second "
                    "needs a folder; rename one of them in S3"
                )
    if folder.is_dir():
        # first: where a file was, the channel may now need a folder (S3's "a" gone, "a/b" new), or the reverse
        _remove_unlisted(folder, set(by_rel))
    for obj in manifest.objects:
        target = (folder / obj.rel).resolve()
        if not target.is_relative_to(folder):
            raise DataError(f"{obj.uri}: its key would be written outside the channel folder; rename it in S3")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            link_or_copy(Path(obj.path), target)
        except OSError as exc:
            if s3.disk_full(exc):
                raise s3.describe_error(exc, obj.uri) from exc
            if exc.errno in (errno.ENAMETOOLONG, errno.EILSEQ, errno.EINVAL):  # a key no path here can hold
                raise DataError(
                    f"{obj.uri}: cannot be laid out as a file under the channel folder ({exc.strerror or exc}); "
                    "rename it in S3"
                ) from exc
            raise StorageError(f"{obj.uri}: laying it out under {folder} failed ({exc}); check that folder") from exc
    return folder


def _remove_unlisted(folder: Path, listed: set[str]) -> None:
    """Remove what an earlier layout of ``folder`` left that the channel no longer lists (a retried task or a
    rerun of the same job id, after an object was deleted in S3): the folder holds the manifest's objects and
    nothing else, so an entrypoint reads what the lineage records."""
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):  # files before their folders
        if path.is_dir() and not path.is_symlink():
            if not any(path.iterdir()):
                path.rmdir()
        elif path.relative_to(folder).as_posix() not in listed:
            path.unlink()
