"""Reading a directory of config.json + safetensors shards into a DeepseekV4Model
(``dsv4.checkpoint.load_model`` builds the model, then ``fill_model`` fills it).

Accepts the reference tensor names and the Hugging Face variant (``names.py``), FP8 block-scaled
and FP4 (1x32) quantized weights (kept as stored by a model holding the published formats,
``native.py``; dequantized for a bf16 model, ``quant.py``), skips MTP tensors with a notice, and checks every name and shape before the first tensor is read: all problems are
reported together in one ``CheckpointError``. Tensors are read and copied one at a time, so the
peak memory is the model plus one tensor. A tensor-parallel rank (``split``) reads only its part
of each sharded tensor (safetensors slices: only those bytes) and only its own routed experts.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ..parallel import shards
from . import native, quant
from .names import is_mtp, to_reference

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"

# safetensors header dtype codes of the quantized encodings.
_FP8_CODES = ("F8_E4M3",)
_PACKED_FP4_CODES = ("I8", "U8")  # two e2m1 codes per byte: the header shape is [n, k/2]
_FP4_CODES = ("F4",)  # float4_e2m1fn_x2: the header shape counts elements, [n, k]


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model; lists every missing, unexpected and mis-shaped
    tensor (``.missing``, ``.unexpected``, ``.mismatched``: lists of message lines)."""

    def __init__(self, path, missing: list[str], unexpected: list[str], mismatched: list[str]):
        self.missing, self.unexpected, self.mismatched = missing, unexpected, mismatched
        lines = [f"checkpoint {path} does not match the model: {len(missing)} missing, "
                 f"{len(unexpected)} unexpected, {len(mismatched)} mis-shaped or malformed"]
        lines += [f"  missing: {m}" for m in missing]
        lines += [f"  unexpected: {u}" for u in unexpected]
        lines += [f"  mis-shaped: {m}" for m in mismatched]
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class Stored:
    """One tensor as the checkpoint stores it (header only)."""
    name: str
    file: Path
    shape: tuple[int, ...]
    code: str  # safetensors dtype code

    def describe(self) -> str:
        return f"{self.name} {self.code}{list(self.shape)} in {self.file.name}"


@dataclass(frozen=True)
class Plan:
    """What to load into one model tensor: the stored tensor and its scale, if quantized."""
    target: str
    value: Stored
    scale: Stored | None


def checkpoint_files(path: Path) -> list[Path]:
    """The shards: those named by the index when there is one, else every *.safetensors."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names shards that do not exist: {absent}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def stores_quantized(stored: dict[str, Stored]) -> bool:
    """Whether a checkpoint (its headers) holds quantized tensors: a scale beside a weight."""
    return any(to_reference(name)[1] for name in stored)


def read_headers(files: list[Path]) -> dict[str, Stored]:
    stored: dict[str, Stored] = {}
    for file in files:
        try:
            opened = safe_open(file, framework="pt")
        except Exception as e:  # safetensors raises its own error type for a bad header
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from e
        with opened as f:
            for name in f.keys():
                s = f.get_slice(name)
                if name in stored:
                    raise ValueError(f"tensor {name} is stored twice: in {stored[name].file.name} "
                                     f"and {file.name}")
                stored[name] = Stored(name, file, tuple(s.get_shape()), s.get_dtype())
    return stored


def plan_load(stored: dict[str, Stored], expected: dict[str, torch.Size], n_layers: int,
              block: tuple[int, int], path) -> tuple[list[Plan], list[str]]:
    """Match stored tensors to the model's: (plans, skipped MTP names). Raises CheckpointError
    naming every missing, unexpected and mis-shaped tensor."""
    values: dict[str, Stored] = {}
    scales: dict[str, Stored] = {}
    mtp: list[str] = []
    unexpected: list[str] = []
    mismatched: list[str] = []
    for name, s in stored.items():
        ref, is_scale = to_reference(name)
        if ref not in expected and is_mtp(ref, n_layers):
            mtp.append(name)
            continue
        table = scales if is_scale else values
        if ref in table:
            mismatched.append(f"{ref}: stored twice, as {table[ref].name} and {name}")
            continue
        table[ref] = s

    missing = [f"{t} (expected shape {list(shape)})" for t, shape in expected.items()
               if t not in values]
    unexpected += [f"{s.describe()}" for t, s in values.items() if t not in expected]
    unexpected += [f"{s.describe()} (a scale with no weight {t})" for t, s in scales.items()
                   if t not in values]
    plans = []
    for target, value in values.items():
        if target not in expected:
            continue
        scale = scales.get(target)
        problem = _check(target, value, scale, tuple(expected[target]), block)
        if problem:
            mismatched.append(problem)
        else:
            plans.append(Plan(target, value, scale))
    if missing or unexpected or mismatched:
        raise CheckpointError(path, missing, unexpected, mismatched)
    return plans, mtp


def _check(target: str, value: Stored, scale: Stored | None, want: tuple[int, ...],
           block: tuple[int, int]) -> str | None:
    """Why the stored tensor (and scale) cannot fill a model tensor of shape ``want``, or None."""
    where = "" if value.name == target else f" (stored as {value.name})"
    if scale is None:
        if value.code in _FP8_CODES + _FP4_CODES:
            return f"{target}{where}: {value.code} weight without a scale tensor"
        shape = value.shape
    elif value.code in _FP8_CODES:
        shape = value.shape
        want_scale = quant.fp8_scale_shape(shape, block) if len(shape) == 2 else None
    elif value.code in _PACKED_FP4_CODES + _FP4_CODES:
        shape = value.shape if value.code in _FP4_CODES else quant.fp4_logical_shape(value.shape)
        want_scale = quant.fp4_scale_shape(shape)
    else:
        return f"{target}{where}: has a scale but dtype {value.code} is not FP8 or packed FP4"
    if shape != want:
        return f"{target}{where}: expected shape {list(want)}, got {list(shape)}"
    if scale is not None and scale.shape != want_scale:
        return (f"{target}: scale {scale.name} expected shape "
                f"{list(want_scale) if want_scale else 'a 2-D weight'}, got {list(scale.shape)}")
    return None


Part = tuple[int, int, int]      # (dim, start, length): a tensor-parallel rank's slice


def _read(handles: dict[Path, object], stored: Stored, part: Part | None = None) -> torch.Tensor:
    """A stored tensor, or only its ``part`` (safetensors reads just those bytes)."""
    if part is None:
        return handles[stored.file].get_tensor(stored.name)
    dim, start, length = part
    index = (slice(None),) * dim + (slice(start, start + length),)
    return handles[stored.file].get_slice(stored.name)[index]


def _read_quantized(plan: Plan, handles, block: tuple[int, int], part: Part | None
                    ) -> tuple[torch.Tensor, torch.Tensor, Part | None]:
    """(stored values, their scales, what to keep of the dequantized values; None: all) of a
    quantized tensor's ``part``, read in the whole scale blocks that cover it."""
    if part is None:
        return _read(handles, plan.value), _read(handles, plan.scale), None
    dim, start, length = part
    per = 2 if plan.value.code in _PACKED_FP4_CODES and dim == len(plan.value.shape) - 1 else 1
    fp4 = plan.value.code not in _FP8_CODES
    b = (1, quant.FP4_BLOCK)[dim] if fp4 else block[dim]
    lo, hi = start // b, -(-(start + length) // b)
    v0, v1 = lo * b, min(hi * b, plan.value.shape[dim] * per)
    value = _read(handles, plan.value, (dim, v0 // per, (v1 - v0) // per))
    scale = _read(handles, plan.scale, (dim, lo, hi - lo))
    keep = None if (v0, v1) == (start, start + length) else (dim, start - v0, length)
    return value, scale, keep


def read_tensor(plan: Plan, handles: dict[Path, object], block: tuple[int, int],
                part: Part | None = None) -> torch.Tensor:
    """The stored value of one model tensor (only its ``part`` when given), dequantized to
    float32 when it is quantized."""
    if plan.scale is None:
        return _read(handles, plan.value, part)
    value, scale, keep = _read_quantized(plan, handles, block, part)
    if plan.value.code in _FP8_CODES:
        value = quant.dequant_fp8(value, scale, block)
    else:
        value = quant.dequant_fp4(value, scale)
    return value if keep is None else value.narrow(*keep)


def check_values(plan: Plan, value: torch.Tensor, config) -> None:
    """Refuse NaN/inf in a float tensor and tid2eid entries outside 0..n_routed_experts-1,
    naming the tensor and its file (DSV4_CHECK_WEIGHTS=0 skips this scan)."""
    where = f"{plan.value.name} in {plan.value.file}"
    if value.is_floating_point():
        bad = ~torch.isfinite(value)
        if bad.any():
            raise ValueError(f"{where}: {int(bad.sum())} NaN/inf values (first at index "
                             f"{bad.flatten().nonzero()[0].item()}); DSV4_CHECK_WEIGHTS=0 "
                             "loads it anyway")
    elif plan.target.endswith("tid2eid"):
        n = config.n_routed_experts
        out = (value < 0) | (value >= n)
        if out.any():
            raise ValueError(f"{where}: expert id {int(value[out].flatten()[0])} is outside "
                             f"0..{n - 1} (n_routed_experts={n})")


def load_native(plan: Plan, handles: dict[Path, object], block: tuple[int, int],
                weight: torch.Tensor, scale: torch.Tensor, options, config,
                part: Part | None = None) -> None:
    """Fill a quantized model weight and its scale: the stored bytes where the checkpoint holds
    the same format (FP8 in the kernels' 128x128 blocks, or packed FP4), else the stored value
    (dequantized when quantized) quantized as the checkpoints are."""
    fp4 = native.is_fp4(weight)
    same_format = plan.scale is not None and (
        plan.value.code in _PACKED_FP4_CODES + _FP4_CODES if fp4
        else plan.value.code in _FP8_CODES and block == quant.DEFAULT_FP8_BLOCK)
    if not same_format:
        value = read_tensor(plan, handles, block, part)
        if options.check_weights:
            check_values(plan, value, config)
        native.copy_quantized(weight, scale, value)
        return
    value, stored_scale, keep = _read_quantized(plan, handles, block, part)
    if keep is not None:       # the split keeps a native model's slices in whole blocks
        raise ValueError(f"{plan.value.name}: the rank's slice {part} is not whole scale blocks")
    if options.check_weights:
        check_values(plan, quant.dequant_fp4(value, stored_scale) if fp4
                    else quant.dequant_fp8(value, stored_scale, block), config)
    native.copy_stored(weight, scale, value, stored_scale, plan.value.name)


def fp8_block_size(raw_config: dict) -> tuple[int, int]:
    qc = raw_config.get("quantization_config") or {}
    block = qc.get("weight_block_size", quant.DEFAULT_FP8_BLOCK)
    return int(block[0]), int(block[1])


def read_config(path: Path) -> dict:
    """The checkpoint's config.json as a dict (a ValueError naming the file if it is not JSON)."""
    try:
        return json.loads((path / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / 'config.json'}: not valid JSON ({e})") from None


def fill_model(model, whole: dict[str, torch.Tensor], path: Path, files: list[Path],
               stored: dict[str, Stored], block: tuple[int, int], options,
               on_tensor=None) -> None:
    """Read the checkpoint's shards ``files`` into ``model``: ``fill_from`` over the opened
    files."""
    with contextlib.ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(f, framework="pt")) for f in files}
        fill_from(model, whole, path, handles, stored, block, options, on_tensor)


def fill_from(model, whole: dict[str, torch.Tensor], path, handles: dict,
              stored: dict[str, Stored], block: tuple[int, int], options,
              on_tensor=None) -> None:
    """Read the checkpoint's tensors into ``model`` (``dsv4.checkpoint.load_model`` builds it).

    ``path`` names the checkpoint in messages; ``handles``: where each stored tensor's ``file``
    is read, by ``get_tensor(name)`` and ``get_slice(name)[index]`` (opened safetensors files,
    or ``held.HeldTensors``). ``whole``: the whole model's tensors (``DeepseekV4Model.whole_model_tensors``): the checkpoint
    is checked against them (every problem in one ``CheckpointError``) before the first tensor is
    read; a tensor-parallel rank's model reads only its slices and routed experts. ``stored``:
    the tensors' headers (``read_headers``); ``block``:
    the FP8 scale block (``fp8_block_size``). ``options``: the model's ``dsv4.Options``; with
    ``options.check_weights`` every tensor is scanned for NaN/inf and tid2eid for experts out of
    range. ``on_tensor``, if given, is called after each tensor is loaded (progress reporting).
    """
    config, split = model.config, model.split
    targets = model.state_dict()
    scales = {name[:-len("weight")] + "scale": name for name in whole
              if name.endswith(".weight") and name[:-len("weight")] + "scale" in whole}
    expected = {k: (native.logical_shape(v) if k in scales.values() else v.shape)
                for k, v in whole.items() if k not in scales}
    plans, mtp = plan_load(stored, expected, config.n_layers, block, path)
    if mtp:
        logger.info("skipping %d MTP tensors (this model has no MTP layers), e.g. %s",
                    len(mtp), mtp[0])

    with torch.no_grad():
        for plan in plans:
            if plan.target not in targets:
                continue                      # another rank's routed expert
            part = shards.part_range(split, plan.target, expected[plan.target])
            scale = targets.get(plan.target[:-len("weight")] + "scale")
            if scale is not None:
                load_native(plan, handles, block, targets[plan.target], scale, options, config,
                            part)
                continue
            value = read_tensor(plan, handles, block, part)
            if options.check_weights:
                check_values(plan, value, config)
            targets[plan.target].copy_(value)
            if on_tensor is not None:
                on_tensor()
    n_quant = sum(p.scale is not None for p in plans)
    logger.info("loaded %d tensors (%d quantized, held %s) from %s", len(plans), n_quant,
                model.weights, path)
