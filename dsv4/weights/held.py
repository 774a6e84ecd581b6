"""Checkpoint tensors held in memory, read by ``loader.fill_from`` as it reads safetensors files.

A serving engine's loader hands its checkpoint tensors over one at a time (SGLang's monokernel
``load_tensor`` hook); ``HeldTensors`` keeps them, by their checkpoint names, and serves the
loader's two reads (``get_tensor``, ``get_slice(...)[index]``) and the headers (``stored()``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from .loader import Stored

# torch dtype -> the safetensors header code the loader decides formats by.
_CODES = {
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e8m0fnu: "F8_E8M0", torch.int8: "I8",
    torch.uint8: "U8", torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
    torch.int32: "I32", torch.int64: "I64", torch.float4_e2m1fn_x2: "F4",
}


Part = tuple[int, int, int]      # (dim, start, length) of a whole tensor that was kept


class HeldTensors:
    """Tensors by checkpoint name; ``where`` names them in the loader's messages. ``parts``: for a
    tensor of which only a part was kept (a tensor-parallel rank's slice), its whole shape and the
    part; the loader then reads only within that part."""

    def __init__(self, tensors: dict[str, torch.Tensor], where: str,
                 parts: dict[str, tuple[tuple[int, ...], Part]] | None = None):
        bad = {name: t.dtype for name, t in tensors.items() if t.dtype not in _CODES}
        if bad:
            raise ValueError(f"tensors: dtypes a checkpoint does not store: {bad}")
        self.tensors = tensors
        self.parts = dict(parts or {})
        self.file = Path(where)

    def stored(self) -> dict[str, Stored]:
        return {name: Stored(name, self.file,
                             self.parts[name][0] if name in self.parts else tuple(t.shape),
                             _CODES[t.dtype])
                for name, t in self.tensors.items()}

    def handles(self) -> dict[Path, "HeldTensors"]:
        return {self.file: self}

    def get_tensor(self, name: str) -> torch.Tensor:
        if name in self.parts:
            raise ValueError(f"{name}: only rows {self.parts[name][1]} of it were kept, and the "
                             "whole tensor was asked for")
        return self.tensors[name]

    def get_slice(self, name: str) -> "_KeptPart | torch.Tensor":
        if name in self.parts:
            return _KeptPart(name, self.tensors[name], self.parts[name][1])
        return self.tensors[name]


class _KeptPart:
    """Indexes a kept part as the whole tensor would be indexed (along the kept dim)."""

    def __init__(self, name: str, tensor: torch.Tensor, part: Part):
        self.name, self.tensor, (self.dim, self.start, self.length) = name, tensor, part

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        index = tuple(index)
        wanted = index[self.dim] if self.dim < len(index) else slice(None)
        start, stop = wanted.start or 0, wanted.stop
        if wanted.step not in (None, 1) or stop is None or start < self.start or \
                stop > self.start + self.length:
            raise ValueError(f"{self.name}: dim {self.dim} [{start}:{stop}] is outside the kept "
                             f"part [{self.start}:{self.start + self.length}]")
        shifted = slice(start - self.start, stop - self.start)
        return self.tensor[index[:self.dim] + (shifted,) + index[self.dim + 1:]]
