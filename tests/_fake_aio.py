"""I/O handles with the AioHandle API for tests: `FakeAio` records every request, can run
each one when it is issued or only when it is waited for, and can fail a chosen write or
read; `DelayedAio` makes another handle's reads finish after random delays."""

from __future__ import annotations

import errno
import os
import random
import time

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


class DelayedFuture:
    """A read that reports done only after a random delay (in wall-clock time)."""

    def __init__(self, inner, delay_s: float):
        self._inner = inner
        self._ready = time.monotonic() + delay_s

    def done(self) -> bool:
        return time.monotonic() >= self._ready and self._inner.done()

    def wait(self):
        left = self._ready - time.monotonic()
        if left > 0:
            time.sleep(left)
        return self._inner.wait()


class DelayedAio:
    """Wraps an I/O handle (a FakeAio or a real AioHandle) so that each read finishes after
    a random delay of up to `max_delay_s` (seeded): a slow, jittery disk. Writes and
    everything else pass through."""

    def __init__(self, inner, *, seed: int, max_delay_s: float = 0.003):
        self._inner = inner
        self._rng = random.Random(seed)
        self.max_delay_s = max_delay_s

    def pread(self, buf, path, offset=0):
        delay = self._rng.uniform(0.0, self.max_delay_s)
        return DelayedFuture(self._inner.pread(buf, path, offset), delay)

    def __getattr__(self, name):
        return getattr(self._inner, name)
