"""An I/O handle with the AioHandle API for tests: records every request, can run each one
when it is issued or only when it is waited for, and can fail a chosen write or read."""

from __future__ import annotations

import errno
import os

import torch


class FakeFuture:
    def __init__(self, run):
        self._run = run
        self._done = False
        self._error: BaseException | None = None

    def _finish(self) -> None:
        if not self._done:
            self._done = True
            try:
                self._run()
            except BaseException as e:
                self._error = e

    def done(self) -> bool:
        return self._done

    def wait(self) -> None:
        self._finish()
        if self._error is not None:
            raise self._error


class FakeAio:
    """`lazy`: a request runs when waited for (as if the disk were slow). `fail_write`: the
    n-th pwrite (0-based) writes half its bytes and then fails with ENOSPC. `fail_read`: the
    n-th pread fails with EIO. `requests` holds (op, offset, nbytes, buffer address)."""

    def __init__(
        self, *, lazy: bool = False, fail_write: int | None = None, fail_read: int | None = None
    ):
        self.lazy = lazy
        self.fail_write = fail_write
        self.fail_read = fail_read
        self.log: list[tuple[str, str, int]] = []
        self.requests: list[tuple[str, int, int, int]] = []
        self.writes = 0
        self.reads = 0

    def _submit(self, run) -> FakeFuture:
        fut = FakeFuture(run)
        if not self.lazy:
            fut._finish()
        return fut

    def pread(self, buf, path, offset=0):
        self.log.append(("read", path, offset))
        view = buf.reshape(-1).view(torch.uint8).numpy()
        self.requests.append(("read", offset, view.nbytes, buf.data_ptr()))
        fail = self.reads == self.fail_read
        self.reads += 1

        def run():
            if fail:
                raise OSError(errno.EIO, os.strerror(errno.EIO), path)
            fd = os.open(path, os.O_RDONLY)
            try:
                data = os.pread(fd, view.nbytes, offset)
            finally:
                os.close(fd)
            if len(data) != view.nbytes:
                raise OSError(errno.EIO, f"short read of {path} at {offset}")
            view[:] = memoryview(data)

        return self._submit(run)

    def pwrite(self, buf, path, offset=0):
        self.log.append(("write", path, offset))
        n = self.writes
        self.writes += 1
        view = buf.reshape(-1).view(torch.uint8).numpy()
        self.requests.append(("write", offset, view.nbytes, buf.data_ptr()))
        fail = n == self.fail_write

        def run():  # reads the buffer when it runs, as the kernel would
            data = bytes(view)
            fd = os.open(path, os.O_WRONLY)
            try:
                if fail:
                    os.pwrite(fd, data[: len(data) // 2], offset)
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                os.pwrite(fd, data, offset)
            finally:
                os.close(fd)

        return self._submit(run)
