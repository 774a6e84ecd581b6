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


class HeldTensors:
    """Tensors by checkpoint name; ``where`` names them in the loader's messages."""

    def __init__(self, tensors: dict[str, torch.Tensor], where: str):
        bad = {name: t.dtype for name, t in tensors.items() if t.dtype not in _CODES}
        if bad:
            raise ValueError(f"tensors: dtypes a checkpoint does not store: {bad}")
        self.tensors = tensors
        self.file = Path(where)

    def stored(self) -> dict[str, Stored]:
        return {name: Stored(name, self.file, tuple(t.shape), _CODES[t.dtype])
                for name, t in self.tensors.items()}

    def handles(self) -> dict[Path, "HeldTensors"]:
        return {self.file: self}

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def get_slice(self, name: str) -> torch.Tensor:
        return self.tensors[name]
