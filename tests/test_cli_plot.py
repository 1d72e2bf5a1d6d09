"""`infinity plot`: the figure's panels hold the records' data, and the PNG it writes is a
real image of the figure's size; a save dir without records is a clear error."""

from __future__ import annotations

import json
import struct

import pytest

from infinity.cli.main import main

pytest.importorskip("matplotlib")

from infinity.cli.plot import PANELS, draw, tokens_seen  # noqa: E402


def _records(steps: int, nvme: bool = True) -> list[dict]:
    out = []
    for s in range(1, steps + 1):
        out.append({
            "step": s, "loss": 5.0 / s, "lr": 1e-3 * min(1, s / 3), "grad_norm": 1.0,
            "step_s": 0.5, "tokens_per_s": 128.0 / 0.5, "forward_seconds": 0.1,
            "backward_seconds": 0.2, "optimizer_seconds": 0.1,
            "nvme_param_wait_seconds": 0.03 if nvme else 0.0, "nvme_optim_wait_seconds": 0.01,
            "nvme_grad_wait_seconds": 0.0,
        })  # fmt: skip
        if s % 4 == 0:
            out.append({"step": s, "eval_loss": 6.0 / s})
    return out


def _write(save_dir, records) -> None:
    save_dir.mkdir(parents=True, exist_ok=True)
    (save_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_each_panel_holds_its_data():
    records = _records(10)
    figure = draw(records)
    axes = figure.get_axes()
    assert [ax.get_title() for ax in axes] == list(PANELS)
    loss, lr, speed, time = axes
    train, val = loss.get_lines()
    assert list(train.get_xdata()) == [128.0 * s for s in range(1, 11)]  # tokens seen
    assert list(train.get_ydata()) == pytest.approx([5.0 / s for s in range(1, 11)])
    assert list(val.get_xdata()) == [128.0 * 4, 128.0 * 8]
    assert list(val.get_ydata()) == pytest.approx([1.5, 0.75])
    assert list(lr.get_lines()[0].get_ydata()) == pytest.approx(
        [r["lr"] for r in records if "lr" in r]
    )
    assert list(speed.get_lines()[0].get_ydata()) == [256.0] * 10
    # 10 steps x (forward, backward, optimizer, other) stacked, and the NVMe waits over them.
    bars = time.patches
    assert len(bars) == 10 * 5
    tops = {round(b.get_y() + b.get_height(), 9) for b in bars[: 10 * 4]}
    assert tops == {0.1, 0.3, 0.4, 0.5}  # each part on the last; the step's 0.5 s in all
    assert {round(b.get_height(), 9) for b in bars[40:]} == {0.04}
    assert tokens_seen(records)[10] == 1280.0


def test_many_steps_are_grouped_into_bars():
    figure = draw(_records(500, nvme=False))
    bars = figure.get_axes()[3].patches
    assert 0 < len(bars) <= 4 * 60 + 60


def test_the_png_is_a_real_image(tmp_path, capsys):
    save = tmp_path / "run"
    _write(save, _records(12))
    assert main(["plot", str(save)]) == 0
    png = (save / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert png[12:16] == b"IHDR"
    width, height = struct.unpack(">II", png[16:24])
    assert (width, height) == (1200, 800)  # 12 x 8 inches at 100 dpi
    assert len(png) > 20_000  # four drawn panels, not a blank canvas
    assert "12 steps" in capsys.readouterr().out
    out = tmp_path / "elsewhere.png"
    assert main(["plot", str(save), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == png[:8]


@pytest.mark.parametrize("what", ["missing", "empty", "not png"])
def test_bad_input_is_one_error(tmp_path, capsys, what):
    save = tmp_path / "run"
    argv = ["plot", str(save)]
    if what == "empty":
        _write(save, [])
    if what == "not png":
        _write(save, _records(2))
        argv += ["--out", str(tmp_path / "x.jpg")]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("infinity: error:"), err
    assert not list(tmp_path.rglob("*.png"))


def test_without_matplotlib_the_error_says_what_to_install(tmp_path, capsys, monkeypatch):
    import sys

    save = tmp_path / "run"
    _write(save, _records(2))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["plot", str(save)]) == 1
    assert "pip install 'infinity-trainer[plot]'" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["partition_bytes", "weights_bytes"])
def test_a_record_with_the_optimizer_weights_key_old_or_new_still_plots(tmp_path, key):
    """The optimizer's host weight bytes were reported as `partition_bytes` before they were
    `weights_bytes` (docs/telemetry.md); a metrics file carrying either key draws as one
    without it."""
    plain = _records(6)
    save = tmp_path / "run"
    _write(save, [{**r, key: 4096} if "loss" in r else r for r in plain])
    assert main(["plot", str(save)]) == 0
    assert (save / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with_key = draw([{**r, key: 4096} if "loss" in r else r for r in plain]).get_axes()
    for ours, theirs in zip(with_key, draw(plain).get_axes(), strict=True):
        assert [list(line.get_ydata()) for line in ours.get_lines()] == [
            list(line.get_ydata()) for line in theirs.get_lines()
        ]
        assert [p.get_height() for p in ours.patches] == [p.get_height() for p in theirs.patches]
