"""Stream Hugging Face safetensors weights, one tensor at a time, into a caller's sink.

`stream_hf_weights(dir, expected, sink)` checks every name and shape from the file headers
before reading any data, then calls `sink(name, tensor)` per tensor. `from_pretrained_dir`
builds the model on the meta device and uses a sink that materializes each parameter; the
engine passes its own sink to write straight into partitions (see infinity.init).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import torch

from infinity.io.aio import AioHandle
from infinity.models.config import LlamaConfig, load_config
from infinity.models.hf_read import Wanted, read_file_into
from infinity.models.llama import LlamaForCausalLM
from infinity.utils import tensor_digests
from infinity.utils.safetensors_stream import SafetensorsReader
from infinity.zero.build_files import BuildPages

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

Sink = Callable[[str, torch.Tensor], None]
PartFn = Callable[[str, tuple[int, ...]], "tuple[int, int] | None"]


def weight_map(model_dir: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (single file or sharded with an index)."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            mapping = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as exc:
            raise ValueError(
                f"{index} is not a valid safetensors index ({exc!r}); re-download it"
            ) from None
        files = {f: model_dir / f for f in set(mapping.values())}
        for f, path in files.items():
            if not path.is_file():
                raise FileNotFoundError(f"{index} lists {f}, which is missing; re-download it")
        return {name: files[f] for name, f in mapping.items()}
    single = model_dir / SINGLE_FILE
    if single.is_file():
        with SafetensorsReader(single) as f:
            return dict.fromkeys(f.names(), single)
    others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(
        p.name for p in model_dir.glob("*.pt*")
    )
    hint = (
        f" (found {others[:3]}: pickle-based weights are not loaded; convert them with "
        "`model.save_pretrained(dir, safe_serialization=True)`)"
        if others
        else ""
    )
    raise FileNotFoundError(f"{model_dir} has no {SINGLE_FILE} or {INDEX_FILE}{hint}")


def tensor_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Shapes from the safetensors headers only (no tensor data is read)."""
    shapes = {}
    by_file: dict[Path, list[str]] = {}
    for name, path in files.items():
        by_file.setdefault(path, []).append(name)
    for path, names in by_file.items():
        with SafetensorsReader(path) as f:
            keys = set(f.names())
            for name in names:
                if name not in keys:
                    raise ValueError(f"the index says {name!r} is in {path}, but it is not there")
                shapes[name] = f.shape(name)
    return shapes


def _ignorable(name: str, config: LlamaConfig | None, ignore: Collection[str]) -> bool:
    if name.endswith("rotary_emb.inv_freq"):
        return True  # older exports saved the RoPE buffer; it is recomputed here
    if name in ignore:
        return True
    return bool(config and config.tie_word_embeddings and name == "lm_head.weight")


def check_names_and_shapes(
    model_dir: Path,
    files: dict[str, Path],
    expected: dict[str, tuple[int, ...]],
    config: LlamaConfig | None = None,
    ignore: Collection[str] = (),
) -> list[str]:
    """The names to load, after checking none is missing, unexpected or of the wrong shape.
    Names in `ignore` (a tied parameter's second name) may be present and are skipped."""
    shapes = tensor_shapes(files)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(n for n in set(shapes) - set(expected) if not _ignorable(n, config, ignore))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s) {missing[:5]}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s) {unexpected[:5]}")
        raise ValueError(
            f"the weights in {model_dir} do not match the model its config.json describes: "
            f"{'; '.join(parts)}; check that config.json belongs to these weights"
        )
    for name, shape in expected.items():
        if tuple(shapes[name]) != tuple(shape):
            raise ValueError(
                f"tensor {name!r} in {files[name]} has shape {list(shapes[name])} but config.json "
                f"implies {list(shape)}; the config and the weights come from different models"
            )
    return [n for n in shapes if n in expected]


def iter_hf_tensors(
    files: dict[str, Path], names: list[str], part: PartFn | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) reading one tensor at a time, file by file.

    With `part`, each tensor is reduced to `part(name, shape) -> (start, numel)` of its
    flattened elements and only those bytes are read (None skips the tensor).
    """
    wanted = set(names)
    for path in sorted(set(files.values())):
        with SafetensorsReader(path) as f:
            for name in f.names():
                if name not in wanted:
                    continue
                if part is None:
                    tensor = f.get_tensor(name)
                    span = (0, tensor.numel())
                else:
                    span = part(name, f.shape(name))
                    if span is None:
                        continue
                    tensor = f.get_flat_slice(name, *span)
                # [Note: base digests]: the bytes are in memory already
                tensor_digests.remember(path, name, *span, tensor_digests.tensor_crc32(tensor))
                yield name, tensor


def stream_hf_weights(
    model_dir: str | os.PathLike,
    expected: dict[str, tuple[int, ...]],
    sink: Sink,
    *,
    config: LlamaConfig | None = None,
    part: PartFn | None = None,
    ignore: Collection[str] = (),
) -> int:
    """Check names/shapes against `expected`, then `sink(name, tensor)` for each. Returns count.

    `part(name, shape) -> (start, numel) | None` makes the sink receive only that 1-D slice of
    each flattened tensor (a rank's shard), reading only its bytes from disk.
    """
    model_dir = Path(model_dir)
    files = weight_map(model_dir)
    names = check_names_and_shapes(model_dir, files, expected, config, ignore)
    count = 0
    for name, tensor in iter_hf_tensors(files, names, part):
        sink(name, tensor)
        del tensor
        count += 1
    return count


def load_hf_into(
    model_dir: str | os.PathLike,
    params: dict[str, torch.Tensor],
    *,
    ignore: Collection[str] = (),
    aio: AioHandle | None = None,
) -> int:
    """Check names and shapes against `params`, then read every tensor into its parameter
    at the disk's speed (see [Note: reading at the disk's speed] in hf_read.py): straight
    into the parameter's memory where the dtypes agree, else through one tensor of the
    file's dtype, cast. A build partition's pages are dropped once it is written (see
    `copying_sink`). Returns the count of tensors read."""
    model_dir = Path(model_dir)
    files = weight_map(model_dir)
    expected = {name: tuple(p.shape) for name, p in params.items()}
    names = check_names_and_shapes(model_dir, files, expected, None, ignore)
    pages = BuildPages(params.values())
    handle = aio if aio is not None else AioHandle()
    try:
        for path in sorted({files[n] for n in names}):
            with SafetensorsReader(path) as f:
                wanted = [_wanted(f, name, params[name]) for name in names if files[name] == path]

            def done(w: Wanted, path: Path = path) -> None:
                param = params[w.name]
                if w.dest.data_ptr() != param.data_ptr():  # read in the file's dtype: cast
                    with torch.no_grad():
                        param.copy_(w.dest.view(param.shape))
                    w.dest = param  # the file-dtype tensor goes
                tensor_digests.remember(path, w.name, 0, param.numel(), w.crc, w.digest)
                pages.release(param)

            read_file_into(path, wanted, done, handle)
    finally:
        if aio is None:
            handle.close()
    return len(names)


def _wanted(f: SafetensorsReader, name: str, param: torch.Tensor) -> Wanted:
    start, stop = f.byte_range(name)
    dtype, shape = f.dtype(name), f.shape(name)
    if param.device.type == "cpu" and param.dtype == dtype and param.is_contiguous():
        return Wanted(name, start, stop, param.detach())
    return Wanted(name, start, stop, lambda: torch.empty(shape, dtype=dtype))


def materializing_sink(model: torch.nn.Module, dtype: torch.dtype | None = None) -> Sink:
    """A sink that replaces each (meta) parameter of `model` by the loaded tensor."""
    owners = {}
    for mod_name, module in model.named_modules():
        for leaf, _ in module.named_parameters(recurse=False):
            owners[f"{mod_name}.{leaf}" if mod_name else leaf] = (module, leaf)

    def sink(name: str, tensor: torch.Tensor) -> None:
        module, leaf = owners[name]
        old = module._parameters[leaf]
        data = tensor.to(dtype or old.dtype)
        module._parameters[leaf] = torch.nn.Parameter(data, requires_grad=old.requires_grad)

    return sink


def copying_sink(model: torch.nn.Module) -> Sink:
    """A sink that copies each tensor into the existing parameter's storage, in place and cast
    to its dtype. Under `infinity.init` that storage is the parameter's partition, so weights
    go straight to their home and nothing else is allocated. With parameters on NVMe the
    partitions are file-backed (see [Note: building on NVMe] in infinity/zero/build.py) and
    each one's pages leave the process once it is written: loading holds one tensor in
    memory, not the model."""
    params = dict(model.named_parameters())
    pages = BuildPages(params.values())

    def sink(name: str, tensor: torch.Tensor) -> None:
        with torch.no_grad():
            params[name].copy_(tensor.view(params[name].shape))
        pages.release(params[name])

    return sink


def expected_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Unique parameter names (tied weights once, under their first name) and shapes."""
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def param_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The HF names and shapes of a LlamaForCausalLM's unique parameters, from the config
    alone (a meta model): what `stream_hf_weights` expects, however the model is built."""
    with torch.device("meta"):
        return expected_shapes(LlamaForCausalLM(config, init_weights=False))


def from_pretrained_dir(
    model_dir: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    sink: Sink | None = None,
) -> LlamaForCausalLM:
    """Build a LlamaForCausalLM from a local HF directory, streaming its weights.

    The model is built on the meta device. With no `sink`, each parameter is materialized on
    the CPU as its tensor is read, cast to `dtype` (default fp32, the dtype the model was
    built in). With a `sink`, every tensor goes there as stored and the returned model keeps
    meta parameters for the caller to fill (the engine's partitions).
    """
    config = load_config(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, init_weights=False)
    own = sink is None
    sink = materializing_sink(model, dtype) if own else sink
    n = stream_hf_weights(model_dir, expected_shapes(model), sink, config=config)
    model.tie_weights()
    if own:
        left = [name for name, p in model.named_parameters() if p.is_meta]
        assert not left, f"parameters not loaded: {left[:5]}"
    log.info("loaded %d tensors from %s", n, model_dir)
    return model
