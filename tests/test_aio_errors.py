"""Bad input to AioHandle: each case raises an exception naming the path, the offset, the
errno text and a hint, on every backend; never a crash, a hang or short data."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import warnings

import numpy as np
import pytest
import torch

from infinity.io import AioError, AioFallbackWarning, AioHandle, aio_checks, aligned_empty
from infinity.io.aio_checks import available_backends

ALL = ["io_uring", "aio", "posix"]
# Every backend with its default submission settings, and the native ones in the three other
# combinations of (single_submit, overlap_events).
MODES = [(b, False, True) for b in ALL] + [
    (b, s, o) for b in ("io_uring", "aio") for s, o in [(True, True), (False, False), (True, False)]
]


@pytest.fixture(params=ALL)
def handle(request):
    if request.param not in available_backends():
        pytest.skip(f"backend {request.param} does not run here (extension or kernel)")
    with AioHandle(backend=request.param, block_size=64 << 10, queue_depth=4) as h:
        yield h


@pytest.fixture
def mount(tmp_path):
    """Mounts a small file system under tmp_path (needs root; skips otherwise)."""
    mounted = []

    def do(fstype: str, options: str = "") -> str:
        target = tmp_path / f"mnt-{fstype}"
        target.mkdir()
        if shutil.which("mount") is None:
            pytest.skip("no mount command here")
        cmd = ["mount", "-t", fstype, *(["-o", options] if options else []), fstype, str(target)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a {fstype} here (needs root): {proc.stderr.strip()}")
        mounted.append(target)
        return str(target)

    yield do
    for target in mounted:
        subprocess.run(["umount", str(target)], check=False)


def test_missing_directory(handle, tmp_path):
    path = tmp_path / "no" / "such" / "dir" / "f.bin"
    with pytest.raises(AioError) as info:
        handle.write(torch.zeros(10, dtype=torch.uint8), path, 5)
    err = info.value
    assert err.errno == errno.ENOENT and err.filename == str(path)
    assert str(path) in str(err) and "No such file" in str(err) and "create it" in str(err)


def test_read_missing_file(handle, tmp_path):
    with pytest.raises(AioError, match="No such file") as info:
        handle.read(torch.empty(10), tmp_path / "absent.bin")
    assert info.value.errno == errno.ENOENT


@pytest.mark.parametrize("offset,nbytes", [(0, 10_001), (9_999, 2), (20_000, 1), (3, 10_000)])
def test_read_past_end_raises(handle, tmp_path, offset, nbytes):
    path = tmp_path / "f.bin"
    handle.write(torch.ones(10_000, dtype=torch.uint8), path)
    buf = aligned_empty(nbytes)
    with pytest.raises(AioError) as info:
        handle.read(buf, path, offset)
    err = info.value
    assert err.errno == errno.ENODATA and err.offset == offset
    assert "holds 10000 bytes" in str(err) and str(path) in str(err)


def test_zero_bytes_at_end_is_fine(handle, tmp_path):
    path = tmp_path / "f.bin"
    handle.write(torch.ones(100, dtype=torch.uint8), path)
    handle.read(torch.empty(0, dtype=torch.uint8), path, 100)


def test_bad_buffers(handle, tmp_path):
    path = tmp_path / "f.bin"
    with pytest.raises(ValueError, match="not contiguous"):
        handle.write(torch.zeros(8, 8).t(), path)
    with pytest.raises(ValueError, match="not C-contiguous"):
        handle.write(np.zeros((8, 8))[:, ::2], path)
    with pytest.raises(TypeError, match="torch.Tensor or numpy.ndarray"):
        handle.write(b"bytes", path)
    handle.write(np.zeros(4), path)
    ro = np.zeros(4)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        handle.read(ro, path)
    with pytest.raises(ValueError, match="offset"):
        handle.write(torch.zeros(4), path, -1)


def test_strict_rejects_unaligned_buffer(tmp_path):
    with AioHandle(strict=True) as h:
        buf = aligned_empty(1 << 20)
        with pytest.raises(ValueError, match="aligned_empty"):
            h.write(buf, tmp_path / "f.bin", 1)
        h.write(buf, tmp_path / "f.bin", 4096)  # same alignment: fine


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        AioHandle(backend="spdk")
    with pytest.raises(ValueError, match="multiple of 4096"):
        AioHandle(block_size=1000)
    with pytest.raises(ValueError, match="queue_depth"):
        AioHandle(queue_depth=0)
    with pytest.raises(ValueError, match="threads"):
        AioHandle(threads=0)


def test_no_permission(tmp_path):
    """EACCES: as root, in a child that drops to 'nobody' (root ignores file modes)."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    os.chmod(locked, 0o500)
    path = locked / "f.bin"
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report the errno through the pipe, never return into pytest
        code = 0
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            with AioHandle(backend="posix") as h:
                h.write(torch.zeros(4), path)
        except AioError as exc:
            code = (
                exc.errno
                if "Permission denied" in str(exc) and "check the owner" in str(exc)
                else -1
            )
        except BaseException:  # noqa: BLE001
            code = -2
        os.write(write_fd, str(code).encode())
        os._exit(0)
    os.close(write_fd)
    os.waitpid(pid, 0)
    assert os.read(read_fd, 64).decode() == str(errno.EACCES)
    os.close(read_fd)


@pytest.mark.parametrize("name,single_submit,overlap_events", MODES)
def test_disk_full(mount, name, single_submit, overlap_events):
    """ENOSPC from a real full file system: a 256 KiB tmpfs, in every submission mode."""
    if name not in available_backends():
        pytest.skip(f"backend {name} does not run here")
    path = os.path.join(mount("tmpfs", "size=256k"), "f.bin")
    modes = {"single_submit": single_submit, "overlap_events": overlap_events}
    with AioHandle(backend=name, block_size=64 << 10, queue_depth=4, **modes) as handle:
        future = handle.pwrite(torch.ones(1 << 20, dtype=torch.uint8), path)
        _check_disk_full(future, path)


def _check_disk_full(future, path: str) -> None:
    with pytest.raises(AioError) as info:
        future.wait()
    err = info.value
    assert err.errno == errno.ENOSPC and err.filename == path
    assert err.offset == 256 << 10  # the first byte past the file system's size
    assert "No space left" in str(err) and "free space" in str(err)
    with pytest.raises(AioError):  # the error stays with the future
        future.wait()
    assert future.done()


@pytest.fixture
def no_direct_dir(tmp_path, mount, monkeypatch):
    """A directory whose file system refuses O_DIRECT: ramfs if it can be mounted, else a
    simulated refusal (EINVAL at open, as tmpfs gave before Linux 6.6)."""
    try:
        return mount("ramfs")
    except pytest.skip.Exception:
        real = aio_checks.open_file

        def refuse(path, write, direct, op):
            if direct:
                raise AioError(errno.EINVAL, op, path, 0, 0, "open with O_DIRECT")
            return real(path, write, direct, op)

        monkeypatch.setattr("infinity.io.aio.open_file", refuse)
        return str(tmp_path)


def test_no_direct_falls_back_with_one_warning(handle, no_direct_dir):
    path = os.path.join(no_direct_dir, "f.bin")
    data = torch.arange(100_000, dtype=torch.int32)
    with pytest.warns(AioFallbackWarning, match="O_DIRECT") as record:
        handle.write(data, path, 4096)
        out = torch.empty_like(data)
        handle.read(out, path, 4096)
        handle.write(data, path, 0)
    assert len([w for w in record if issubclass(w.category, AioFallbackWarning)]) == 1
    assert torch.equal(out, data)


def test_no_direct_strict_raises(no_direct_dir):
    path = os.path.join(no_direct_dir, "f.bin")
    with AioHandle(strict=True) as h, warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AioError) as info:
            h.write(torch.zeros(4096, dtype=torch.uint8), path)
    assert info.value.errno == errno.EINVAL and "O_DIRECT" in str(info.value)


@pytest.mark.parametrize("name,single_submit,overlap_events", MODES)
def test_engine_short_read_then_eof(tmp_path, name, single_submit, overlap_events):
    """Below the handle's size check (e.g. a file truncated meanwhile), the engines resume
    a short read and report the end of the file as ENODATA at the offset where data ended."""
    if name not in available_backends():
        pytest.skip(f"backend {name} does not run here")
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * 40)  # 10240 bytes
    engine = aio_checks.make_engine(name, 4096, 4, 1, single_submit, overlap_events)
    buf = aligned_empty(16384)
    fd = os.open(path, os.O_RDONLY)
    try:
        ticket = engine.submit(False, fd, buf.data_ptr(), 16384, 0)
        code, offset, what = engine.wait(ticket)
        assert (code, offset) == (errno.ENODATA, 10240) and "end of file" in what
        assert buf[:10240].numpy().tobytes() == path.read_bytes()
        ticket = engine.submit(False, fd, buf.data_ptr() + 3, 1000, 9000)  # short, then done
        assert engine.wait(ticket) is None
        assert buf[3:1003].numpy().tobytes() == path.read_bytes()[9000:10000]
    finally:
        os.close(fd)
        engine.close()


class _Interrupt(KeyboardInterrupt):
    """What a signal handler raises (infinity train's stop at once is one)."""


def test_a_wait_interrupted_by_a_signal_is_finished_by_the_next(handle, tmp_path):
    """A signal handler's exception lands right after the engine hands over a piece's result:
    the clean-up's wait must finish the request (no piece waited twice, no unknown ticket)
    and report the lost result as EINTR; closing the handle then logs no failure."""
    path = str(tmp_path / "f")
    buf = aligned_empty(3 * (64 << 10), torch.uint8)  # several pieces under the posix twin
    handle.pwrite(buf, path, 0).wait()
    future = handle.pread(buf, path, 0)
    engine, calls = handle._engine, []

    class Interrupting:
        def __getattr__(self, name):
            return getattr(engine, name)

        def wait(self, ticket):
            result = engine.wait(ticket)
            calls.append(ticket)
            if len(calls) == 1:
                raise _Interrupt  # the result of this piece is lost
            return result

    future._engine = Interrupting()
    with pytest.raises(_Interrupt):
        future.wait()
    with pytest.raises(AioError) as err:
        future.wait()
    assert err.value.errno == errno.EINTR and "interrupted" in str(err.value.strerror)
    assert calls.count(calls[0]) == 1  # the interrupted piece was collected once only
    assert future.done()
