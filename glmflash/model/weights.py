"""Checkpoint loading: safetensors (sharded or single), memory-mapped, tensor by tensor.

Parameter names match the checkpoint (spec/model.md §7.2), so loading is a lookup; the one
packed name is the per-expert layout, stacked into `[E, ...]` parameters. FP8 tensors stay FP8.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from glmflash.kernels.fp8_gemm import FP8_DTYPE

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
_EXPERT = re.compile(
    r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$"
)
_LAYER = re.compile(r"^model\.language_model\.layers\.(\d+)\.")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CheckpointError(RuntimeError):
    """A checkpoint that does not fit the model; the message names the tensor and the file."""


class CheckpointLayout:
    """How this process's parameters relate to the checkpoint: here, one to one. A rank of a
    split model (glmflash/distributed) overrides it to read only its part of each tensor."""

    def skip_reason(self, name: str) -> str | None:
        """Why the tensor `name` is not loaded here (None: it is)."""
        return None

    def local_expert(self, target: str, index: int) -> int | None:
        """Row of the stacked parameter `target` that expert `index` goes to (None: not here)."""
        return index

    def read(self, handle, name: str, target: str) -> torch.Tensor:
        """The part of tensor `name` that parameter `target` holds."""
        return handle.get_tensor(name)


@dataclass
class LoadReport:
    num_loaded: int = 0
    skipped: dict[str, int] = field(default_factory=dict)


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> shard file, from model.safetensors.index.json or the *.safetensors files."""
    root = Path(path)
    index = root / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:  # TypeError: not an object
            raise CheckpointError(f"{index}: not a safetensors index ({exc})") from exc
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: weight_map must be an object")
        files = {name: root / shard for name, shard in weight_map.items()}
        for shard in sorted(set(files.values())):
            if not shard.exists():
                raise CheckpointError(f"{index} lists shard {shard.name}, which is missing")
        return files
    shards = sorted(root.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"no weights in {root}: neither {INDEX_FILE} nor any "
                              "*.safetensors file (load_format='dummy' runs random weights "
                              "without them)")
    files: dict[str, Path] = {}
    for shard in shards:
        for name in _open(shard).keys():
            files[name] = shard
    return files


def load_checkpoint(model: nn.Module, path: str | Path, *, num_layers: int,
                    progress: bool = True, layout: CheckpointLayout | None = None) -> LoadReport:
    """Copy every checkpoint tensor into `model`; every parameter must be written exactly once."""
    layout = layout or CheckpointLayout()
    params = dict(model.named_parameters())
    files = checkpoint_files(path)
    report, written = LoadReport(), set()
    names = sorted(files, key=lambda n: (str(files[n]), n))
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    with tqdm(total=len(names), desc="Loading checkpoint", unit="tensor",
              disable=not progress) as bar:  # closed before an error is reported
        _load_shards(by_file, params, layout, num_layers, report, written, bar)
    _check_complete(params, written, path)
    for reason, count in report.skipped.items():
        logger.info("skipped %d tensors: %s", count, reason)
    return report


def _load_shards(by_file: dict[Path, list[str]], params: dict, layout: CheckpointLayout,
                 num_layers: int, report: LoadReport, written: set, bar) -> None:
    """Each shard's tensors into their parameters (or skipped, with the reason counted)."""
    for shard, shard_names in by_file.items():
        handle = _open(shard)
        for name in shard_names:
            bar.update(1)
            reason = _skip_reason(name, num_layers, params) or layout.skip_reason(name)
            target, index = (None, None) if reason else _target(name, params, shard, layout)
            if target is None:
                reason = reason or "routed experts held by other ranks"
                report.skipped[reason] = report.skipped.get(reason, 0) + 1
                continue
            tensor = _read(handle, name, target, shard, layout)
            _copy(params[target], index, tensor, name, shard)
            written.add((target, index))
            report.num_loaded += 1


def _open(shard: Path):
    try:
        return safe_open(str(shard), framework="pt")
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise CheckpointError(f"{shard}: cannot read safetensors file ({exc})") from exc


def _read(handle, name: str, target: str, shard: Path, layout: CheckpointLayout
          ) -> torch.Tensor:
    try:
        return layout.read(handle, name, target)
    except Exception as exc:
        raise CheckpointError(f"tensor {name} in {shard}: cannot read ({exc})") from exc


def _skip_reason(name: str, num_layers: int, params: dict[str, nn.Parameter]) -> str | None:
    layer = _LAYER.match(name)
    if layer and int(layer.group(1)) >= num_layers:
        return "MTP block (next-token prediction: loaded with speculative decoding)"
    if name.startswith("model.visual.") and not any(p.startswith("model.visual.") for p in params):
        return "vision tower (not built: text-only model)"
    return None


def _target(name: str, params: dict[str, nn.Parameter], shard: Path, layout: CheckpointLayout
            ) -> tuple[str | None, int | None]:
    """(parameter, expert row or None) of a tensor; (None, None) for an expert held elsewhere."""
    expert = _EXPERT.match(name)
    if expert:
        prefix, e, proj, kind = expert.groups()
        target, index = f"{prefix}.{proj}.{kind}", layout.local_expert(
            f"{prefix}.{proj}.{kind}", int(e))
        if index is None:
            return None, None
    else:
        target, index = name, None
    if target not in params:
        raise CheckpointError(f"unexpected tensor {name} in {shard}: "
                              "the model has no such weight")
    if index is not None and index >= params[target].shape[0]:
        raise CheckpointError(f"unexpected tensor {name} in {shard}: expert {index} is out of "
                              f"range (the config has {params[target].shape[0]} experts)")
    return target, index


def _copy(param: nn.Parameter, index: int | None, tensor: torch.Tensor, name: str,
          shard: Path) -> None:
    dest = param.data if index is None else param.data[index]
    if tuple(tensor.shape) != tuple(dest.shape):
        raise CheckpointError(f"tensor {name} in {shard} has shape {tuple(tensor.shape)}, "
                              f"expected {tuple(dest.shape)}")
    _check_dtype(dest.dtype, tensor.dtype, name, shard)
    with torch.no_grad():
        dest.copy_(tensor if tensor.dtype == dest.dtype else tensor.to(dest.dtype))


def _check_dtype(expected: torch.dtype, actual: torch.dtype, name: str, shard: Path) -> None:
    if expected == FP8_DTYPE:
        ok = actual == FP8_DTYPE
        want = "F8_E4M3 (the config's quantization_config says fp8)"
    elif name.endswith("weight_scale_inv"):
        ok, want = actual == torch.float32, "F32"
    else:
        ok, want = actual in _FLOAT_DTYPES, "a float type (F32, BF16 or F16)"
    if not ok:
        raise CheckpointError(f"tensor {name} in {shard} has dtype {actual}, expected {want}")


def _check_complete(params: dict[str, nn.Parameter], written: set, path: str | Path) -> None:
    missing = []
    for name, param in params.items():
        indices = range(param.shape[0]) if _is_stacked(name) else [None]
        missing += [_disk_name(name, i) for i in indices if (name, i) not in written]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        shown = ", ".join(missing[:5]) + more
        raise CheckpointError(f"checkpoint {path} is missing {len(missing)} tensors: {shown}")


def _is_stacked(name: str) -> bool:
    return ".mlp.experts." in name


def _disk_name(name: str, index: int | None) -> str:
    if index is None:
        return name
    prefix, proj, kind = name.rsplit(".", 2)
    return f"{prefix}.{index}.{proj}.{kind}"


def iter_state_dict_for_save(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's tensors under their checkpoint names (experts unstacked), for writing."""
    for name, param in model.named_parameters():
        if _is_stacked(name):
            for e in range(param.shape[0]):
                yield _disk_name(name, e), param.data[e]
        else:
            yield name, param.data
