"""``flock`` as NFS takes it, for tests of a cache on a shared NFS volume (EFS, a ReadWriteMany volume)."""

from __future__ import annotations

import errno
import fcntl
import os


def nfs_flock(real):
    """flock as NFS takes it: a byte-range lock, so an exclusive one on a file opened read-only is refused (EBADF)."""

    def flock(fd: int, operation: int) -> None:
        if operation & fcntl.LOCK_EX and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY:
            raise OSError(errno.EBADF, "Bad file descriptor")
        real(fd, operation)

    return flock
