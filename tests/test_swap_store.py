"""The swap store: layout, lock, modes, cleanup and the checks made before writing."""

from __future__ import annotations

import errno
import logging
import os
import stat
import subprocess
import sys
import textwrap
from collections import namedtuple

import pytest

from infinity.swap import store as store_mod
from infinity.swap.store import (
    ALIGN_BYTES,
    SwapStore,
    SwapStoreError,
    find_stale_dirs,
    remove_stale_dirs,
)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_layout_aligned_disjoint_and_stable(tmp_path):
    sizes = {"a.weight": 1, "b.weight": 4096, "c.bias": 5000, "empty": 0, "d": 70_000}
    with SwapStore(tmp_path, run_id="t", file_bytes=64 << 10) as store:
        extents = store.reserve("param", sizes)
        assert list(extents) == list(sizes)
        by_file: dict[str, list] = {}
        for key, ext in extents.items():
            assert ext.nbytes == sizes[key]
            assert ext.offset % ALIGN_BYTES == 0 and ext.padded_nbytes % ALIGN_BYTES == 0
            assert ext.padded_nbytes >= max(ext.nbytes, 1)
            assert store.extent("param", key) == ext
            by_file.setdefault(ext.path, []).append(ext)
        # 64 KiB files: several files, "d" (larger than a file) alone in its own
        assert len(by_file) == len(store.files("param")) >= 2
        for path, exts in by_file.items():
            exts.sort(key=lambda e: e.offset)
            for x, y in zip(exts, exts[1:], strict=False):
                assert x.offset + x.padded_nbytes <= y.offset
            assert os.path.getsize(path) == exts[-1].offset + exts[-1].padded_nbytes
        assert store.reserved_bytes == sum(os.path.getsize(p) for p in store.files())


def test_files_private_and_removed_on_close(tmp_path):
    store = SwapStore(tmp_path, run_id="t", rank=3)
    store.reserve("optim", {"subgroup.0": 10_000})
    store.reserve("param", {"w": 100})
    assert store.dir == os.path.join(str(tmp_path), "infinity-t", "rank3")
    assert _mode(store.dir) == 0o700
    for path in store.files() + [os.path.join(store.dir, "lock")]:
        assert _mode(path) == 0o600, path
    store.close()
    store.close()  # idempotent
    assert os.listdir(tmp_path) == []
    with pytest.raises(SwapStoreError, match="closed"):
        store.reserve("param", {"x": 1})


def test_duplicate_and_unknown_keys(tmp_path):
    with SwapStore(tmp_path, run_id="t") as store:
        store.reserve("param", {"w": 8})
        with pytest.raises(ValueError, match="already reserved"):
            store.reserve("param", {"w": 8})
        store.reserve("optim", {"w": 8})  # kinds are separate namespaces
        with pytest.raises(KeyError, match="reserve"):
            store.extent("param", "nope")


def test_second_store_on_same_dir_fails_naming_pid(tmp_path):
    with SwapStore(tmp_path, run_id="shared"):
        with pytest.raises(SwapStoreError, match=f"pid {os.getpid()}"):
            SwapStore(tmp_path, run_id="shared")
        SwapStore(tmp_path, run_id="shared", rank=1).close()  # another rank is fine


def test_lock_excludes_another_process(tmp_path):
    code = textwrap.dedent(
        f"""
        from infinity.swap.store import SwapStore, SwapStoreError
        try:
            SwapStore({str(tmp_path)!r}, run_id="shared")
        except SwapStoreError as e:
            print("refused:", e)
        """
    )
    with SwapStore(tmp_path, run_id="shared"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert "refused:" in out.stdout and f"pid {os.getpid()}" in out.stdout, out
    # once released, another process may take it (and cleans up at exit)
    code = code.replace('print("refused:", e)', "raise")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert os.listdir(tmp_path) == []


def test_killed_run_leaves_stale_dir_that_is_reported(tmp_path):
    code = textwrap.dedent(
        f"""
        import os, signal
        from infinity.swap.store import SwapStore
        s = SwapStore({str(tmp_path)!r}, run_id="dead")
        s.reserve("optim", {{"g": 4096}})
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    subprocess.run([sys.executable, "-c", code])
    stale = os.path.join(str(tmp_path), "infinity-dead", "rank0")
    assert find_stale_dirs(str(tmp_path)) == [stale]
    with SwapStore(tmp_path, run_id="live") as store:
        assert find_stale_dirs(str(tmp_path)) == [stale]  # the live run's dir is locked
        with pytest.raises(SwapStoreError, match="left by runs that are gone.*infinity-dead"):
            store.reserve("optim", {"huge": 1 << 62})
    assert remove_stale_dirs(str(tmp_path)) == [stale]
    assert not os.path.exists(os.path.dirname(stale))
    subprocess.run([sys.executable, "-c", code])
    # the same run id again takes over the directory and drops the dead run's files
    with SwapStore(tmp_path, run_id="dead") as store:
        assert [f for f in os.listdir(store.dir) if f.endswith(".swp")] == []
        store.reserve("optim", {"g": 4096})


def test_free_space_checked_before_writing(tmp_path, monkeypatch):
    fake = namedtuple("statvfs", "f_bavail f_frsize")(f_bavail=10, f_frsize=4096)
    with SwapStore(tmp_path, run_id="t") as store:
        monkeypatch.setattr(store_mod.os, "statvfs", lambda p: fake)
        with pytest.raises(SwapStoreError) as err:
            store.reserve("optim", {"g": 1 << 20})
        msg = str(err.value)
        assert str(1 << 20) in msg and str(40960) in msg and str(tmp_path) in msg
        assert store.files() == []
        assert [f for f in os.listdir(store.dir) if f.endswith(".swp")] == []


@pytest.mark.parametrize("case", ["missing", "file", "readonly"])
def test_bad_paths_name_the_path(tmp_path, monkeypatch, case):
    path = tmp_path / "swap"
    if case == "file":
        path.write_text("x")
    elif case == "readonly":
        path.mkdir(mode=0o500)
        real_access = os.access  # root ignores modes: pretend to be an ordinary user
        monkeypatch.setattr(
            store_mod.os, "access", lambda p, m: False if str(p) == str(path) else real_access(p, m)
        )
    with pytest.raises(SwapStoreError, match=str(path)) as err:
        SwapStore(path)
    fix = {"missing": "mkdir -p", "file": "not a directory", "readonly": "permissions"}[case]
    assert fix in str(err.value)


def test_no_o_direct_falls_back_to_buffered_with_warning(tmp_path, monkeypatch, caplog):
    real_open = os.open

    def refusing_open(path, flags, *args):  # what tmpfs before Linux 6.6 and overlayfs do
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(store_mod.os, "open", refusing_open)
    with (
        caplog.at_level(logging.WARNING, logger="infinity.swap.store"),
        SwapStore(tmp_path, run_id="t") as store,
    ):
        assert store.direct is False
        store.reserve("param", {"w": 100})
    assert any("O_DIRECT" in r.getMessage() for r in caplog.records)
    assert os.listdir(tmp_path) == []


def test_tmpfs_works(caplog):
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    run_id = f"test{os.getpid()}"
    with (
        caplog.at_level(logging.WARNING, logger="infinity.swap.store"),
        SwapStore("/dev/shm", run_id=run_id) as store,
    ):
        # tmpfs accepts O_DIRECT from Linux 6.6 on; before, the store says so and goes on
        warned = any("O_DIRECT" in r.getMessage() for r in caplog.records)
        assert store.direct is not warned
        assert store.fs_type == "tmpfs"
        assert any("stay in RAM" in r.getMessage() for r in caplog.records)
        store.reserve("param", {"w": 100})
    assert not os.path.exists(f"/dev/shm/infinity-{run_id}")
