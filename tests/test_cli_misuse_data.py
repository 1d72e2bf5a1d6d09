"""More of a new user's mistakes (see test_cli_misuse.py for the pattern): `infinity estimate`
at shapes a run cannot take, data files of other kinds, a config's batch and NVMe settings
with the flags. Each ends with one clear message, no traceback, no changed checkpoint; the
cases that must succeed run for real."""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest
from _train_inputs import write_inputs

from infinity.checkpoint import load_checkpoint
from infinity.cli.main import main

pytestmark = pytest.mark.usefixtures("quiet_root_logger")


class World:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.model, self.data = write_inputs(root)
        self.paths: dict[str, Path] = {"model": self.model, "data": self.data}

    def __getitem__(self, name: str) -> str:
        return str(self.paths[name])

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.root / "files" / name
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        self.paths[name] = path
        return path


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    w = World(tmp_path_factory.mktemp("misuse_more"))
    w.file("corpus.txt", "plain text, one document. " * 200)
    w.file("corpus.jsonl.zst", b"\x28\xb5\x2f\xfd" + bytes(64))
    w.file("records.json", json.dumps({"data": [{"text": "a b c"}] * 3}, indent=2))
    w.file("torn.json", '[{"text": "a b c"}, {"text": "d e')
    w.file("torn.txt.gz", gzip.compress(b"some text " * 500)[:-20])
    w.file("tbs8.json", json.dumps({"train_batch_size": 8}))
    w.file("tbs4.json", json.dumps({"train_batch_size": 4}))
    w.file("nvme_no_path.json", json.dumps(
        {"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}))  # fmt: skip
    good = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}\n"
    w.file("good.jinja", good + "{% if add_generation_prompt %}<s>assistant: {% endif %}")
    w.file("broken.jinja", "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}\n")
    w.file("raising.jinja", "{% for m in messages %}\n{{ raise_exception('no tools here') }}"
                            "\n{% endfor %}\n")  # fmt: skip
    turn = [{"role": "user", "content": "q?"}, {"role": "assistant", "content": "a!"}]
    w.file("chat.jsonl", "".join(json.dumps({"messages": turn}) + "\n" for _ in range(8)))
    w.file("assistant_first.jsonl", json.dumps({"messages": turn}) + "\n"
           + json.dumps({"messages": turn[::-1]}) + "\n")  # fmt: skip
    long_pair = {"prompt": "p" * 40, "completion": "c" * 40}
    w.file("long_pairs.jsonl", "".join(json.dumps(long_pair) + "\n" for _ in range(5)))
    short = w.root / "short_positions"
    shutil.copytree(w.model, short)
    cfg = json.loads((short / "config.json").read_text())
    (short / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 8}))
    w.paths["short_positions"] = short
    w.paths["run"] = w.root / "runs" / "done"
    assert main(_train(w, "--save-dir", w["run"], "--steps", "2")) == 0
    return w


def _train(w: World, *extra: str, model: str = "model", data: str = "data") -> list[str]:
    return [
        "train", "--model", w[model], "--data", w[data], "--save-dir", str(w.root / "runs" / "x"),
        "--seq-len", "16", "--steps", "1", "--no-progress", *extra,
    ]  # fmt: skip


def _estimate(w: World, *extra: str, model: str = "model") -> list[str]:
    return ["estimate", "--model", w[model], "--seq-len", "16", *extra]


def _digest(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


# (id, argv from the world, exit code, phrase the message must contain)
# fmt: off
CASES = [
    # -- estimate: the checks train makes, and shapes no machine runs (before any probe)
    ("estimate-seq-len-past-positions", lambda w: _estimate(w, model="short_positions"),
     1, "longer than the model's max_position_embeddings (8)"),
    ("estimate-micro-batch-huge", lambda w: _estimate(w, "--micro-batch", "1000000000000"),
     1, "this run cannot fit: the activations of one micro batch (1000000000000 x 16 tokens)"),
    ("estimate-lora-r-huge", lambda w: _estimate(w, "--lora-r", "1000000000"),
     1, "LoRA rank r (--lora-r) 1000000000 is larger than layer"),
    ("train-lora-r-huge", lambda w: _train(w, "--lora-r", "1000000"),
     1, "LoRA rank r (--lora-r) 1000000 is larger than layer"),
    # -- data files
    ("data-field-on-text", lambda w: _train(w, "--data-field", "body", data="corpus.txt"),
     1, "--data-field body names a field of JSON records"),
    ("data-zstd", lambda w: _train(w, data="corpus.jsonl.zst"), 1, "zstd -d"),
    ("data-json-object", lambda w: _train(w, data="records.json"),
     1, "a .json data file must be one JSON array of records"),
    ("data-json-torn", lambda w: _train(w, data="torn.json"),
     1, "is not a JSON array of records"),
    ("data-gzip-damaged", lambda w: _train(w, data="torn.txt.gz"),
     1, "is gzip-compressed and its data is damaged or cut short"),
    # -- instruction data: the chat template, the records, what --overlong drop leaves
    ("chat-template-syntax", lambda w: _train(w, "--chat-template", w["broken.jinja"],
                                              data="chat.jsonl"),
     1, "broken.jinja line 2 is not a valid Jinja template"),
    ("chat-template-raises", lambda w: _train(w, "--chat-template", w["raising.jinja"],
                                              data="chat.jsonl"),
     1, "raising.jinja line 2 failed while rendering"),
    ("chat-assistant-first", lambda w: _train(w, "--chat-template", w["good.jinja"],
                                              data="assistant_first.jsonl"),
     1, "assistant_first.jsonl line 2: the conversation starts with an assistant message"),
    ("pack-drop-everything", lambda w: _train(w, "--pack", "--overlong", "drop",
                                              data="long_pairs.jsonl"),
     1, "all 5 examples were dropped (5 longer than --seq-len 16 + 1 tokens (--overlong drop"),
    # -- a config's batch with one of the flags; NVMe paths
    ("config-batch-with-micro-batch", lambda w: _train(w, "--config", w["tbs8.json"],
                                                       "--micro-batch", "3"),
     1, "--micro-batch 3 with the train_batch_size 8"),
    ("nvme-parent-missing", lambda w: _train(w, "--nvme", str(w.root / "nowhere" / "ssd")),
     1, "its parent"),
]
# fmt: on


@pytest.mark.parametrize("argv_of, code, phrase", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_misuse_ends_with_one_clear_message(world, capsys, argv_of, code, phrase):
    before = _digest(world.paths["run"])
    got, out, err = _run(argv_of(world), capsys)
    assert "Traceback" not in err, err
    assert got == code, (got, out, err)
    assert phrase in err, err
    assert _digest(world.paths["run"]) == before, "a checkpoint changed"


def test_a_missing_nvme_parent_is_refused_before_tokenizing(world, tmp_path, capsys):
    save = tmp_path / "run"
    argv = _train(
        world,
        "--nvme",
        str(tmp_path / "no" / "ssd"),
        "--placement",
        "nvme",
        "--save-dir",
        str(save),
    )
    assert _run(argv, capsys)[0] == 1
    assert not (save / "tokens").exists()


def test_an_nvme_directory_whose_parent_exists_is_created(world, tmp_path, capsys):
    nvme = tmp_path / "ssd"
    argv = _train(
        world, "--nvme", str(nvme), "--placement", "nvme", "--save-dir", str(tmp_path / "run")
    )
    code, _, err = _run(argv, capsys)
    assert code == 0, err
    assert nvme.is_dir()


def test_nvme_flag_gives_the_path_a_config_leaves_out(world, tmp_path, capsys):
    nvme = tmp_path / "ssd"
    argv = _train(world, "--config", world["nvme_no_path.json"], "--nvme", str(nvme),
                  "--placement", "nvme", "--save-dir", str(tmp_path / "run"))  # fmt: skip
    code, _, err = _run(argv, capsys)
    assert code == 0, err


def test_a_config_train_batch_size_stays_with_micro_batch(world, tmp_path, capsys):
    save = tmp_path / "run"
    argv = _train(world, "--config", world["tbs4.json"], "--micro-batch", "2",
                  "--save-dir", str(save))  # fmt: skip
    code, _, err = _run(argv, capsys)
    assert code == 0, err
    run = load_checkpoint(save).state["run"]
    assert (run["micro_batch"], run["grad_accum"]) == (2, 2)  # 4 = 2 x 2, not 2 x 1


def test_a_tiny_nvme_run_does_not_warn_about_buffers(world, tmp_path, caplog, capsys):
    caplog.set_level(logging.WARNING)
    argv = _train(world, "--model", "tiny", "--byte-tokens", "--nvme", str(tmp_path / "ssd"),
                  "--placement", "nvme", "--save-dir", str(tmp_path / "run"))  # fmt: skip
    code, _, err = _run(argv, capsys)
    assert code == 0, err
    assert "buffer_count" not in caplog.text


def test_engine_progress_lines_go_above_the_progress_bar(world, tmp_path):
    """With the bar on, the engine's `step N: lr ...` line is written through the bar
    (tqdm's logging redirect): the bar is cleared first and the line ends before the bar is
    drawn again, so no line lands inside a bar frame, in a terminal or a log file."""
    import os
    import subprocess
    import sys

    from _train_inputs import ROOT

    cfg = tmp_path / "print.json"
    cfg.write_text(json.dumps({"steps_per_print": 2}))
    args = _train(world, "--config", str(cfg), "--steps", "4", "--save-dir", str(tmp_path / "r"))
    args.remove("--no-progress")
    env = dict(os.environ, PYTHONPATH=str(ROOT), INFINITY_ACCELERATOR="cpu")
    done = subprocess.run([sys.executable, "-m", "infinity.cli.main", *args], env=env,
                          capture_output=True, timeout=300)  # fmt: skip
    err = done.stderr.decode()  # bytes: text mode would turn the bar's \r into \n
    assert done.returncode == 0, err
    lines = [i for i in range(len(err)) if err.startswith("INFO infinity.engine: step", i)]
    assert len(lines) == 2, err
    assert "step/s" in err  # the bar was drawn
    for at in lines:
        assert err[at - 1] == "\r", repr(err[at - 200 : at + 80])  # the bar cleared first
        assert "%|" not in err[at : err.index("\n", at)]  # the line is whole


def test_a_disk_full_while_appending_metrics_names_the_file_and_keeps_the_checkpoints(
    world, tmp_path, capsys, monkeypatch
):
    """metrics.jsonl's third append lands on a full disk (/dev/full gives the kernel's
    ENOSPC): the run stops naming the file, the fix and the intact checkpoint, whose bytes
    it leaves as they were, and resumes from it to the losses of a run that never failed."""
    import builtins

    import infinity.checkpoint.metrics as metrics

    save = tmp_path / "run"
    opened, saved = [], {}

    def third_is_full(path, mode="r", *args, **kw):
        opened.append(path)
        if len(opened) == 3:
            saved.update(_digest(save))
        return builtins.open("/dev/full" if len(opened) == 3 else path, mode, *args, **kw)

    monkeypatch.setattr(metrics, "open", third_is_full, raising=False)
    argv = _train(world, "--steps", "4", "--save-every", "1", "--save-dir", str(save))
    code, _, err = _run(argv, capsys)
    monkeypatch.undo()
    assert code == 1 and "Traceback" not in err, err
    assert f"cannot append step 3's record to {save / 'metrics.jsonl'}: No space left" in err
    assert f"checkpoint {save / 'step2'} is intact: free space on that file system" in err
    checkpoints = {k: v for k, v in saved.items() if k.startswith("step")}
    assert checkpoints and {k: _digest(save)[k] for k in checkpoints} == checkpoints
    assert load_checkpoint(save).step == 2
    assert _run([*argv, "--resume"], capsys)[0] == 0
    whole = tmp_path / "whole"
    argv = _train(world, "--steps", "4", "--save-every", "1", "--save-dir", str(whole))
    assert _run(argv, capsys)[0] == 0

    def losses(run):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["loss"] for line in lines]

    assert losses(save) == losses(whole)
