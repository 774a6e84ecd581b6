"""Teacher-forced logits of DeepSeek-V4's published reference inference code (inference/model.py,
kept OUTSIDE this repository) on a checkpoint written by ``dsv4.checkpoint.save_random_checkpoint``
(reference naming), on a CPU, with the TileLang kernels replaced by ``kernel_shims`` (our own
torch code that follows their numerics).

    python scripts/reference_oracle/run_reference.py --reference-dir PATH/TO/inference \\
        --checkpoint CKPT_DIR --tokens random:300:0 --out ref_logits.safetensors [--mode fp8]

--tokens: "random:LEN:SEED" (seeded ids in [2, vocab)), a comma-separated id list, or a path to a
.json list / .pt tensor. The run is the reference's own decode: a prefill of the first token
(``model.forward(tokens[:, :1], 0)``), then one token per step (``model.forward(tokens[:, i:i+1],
i)``), the way its generate.py feeds prompt tokens after the first pass. logits[i] are those
computed at position i (predicting token i + 1); all fp32, saved with the token ids. --prefill P
makes the first pass the first P tokens (the reference's prefill, ``forward(tokens[:, :P], 0)``,
whose logits are those of position P - 1).

The reference is built with ``scale_dtype="fp8"`` (so ``scale_fmt = "ue8m0"``: power-of-two
scales, as in the published config), torch's default dtype bf16 as generate.py sets it, and, by
--mode:
- "bf16" (default): ``dtype="bf16"``, ``expert_dtype=None``: its ``linear`` is ``F.linear`` in
  bf16, which is what this repo's model runs on dequantized weights. The checkpoint must be
  unquantized (``save_random_checkpoint(..., quantize=False)``).
- "fp8": ``dtype="fp8"``, ``expert_dtype="fp4"``, as published: every linear the checkpoint holds
  quantized runs ``act_quant`` + ``fp8_gemm`` / ``fp4_gemm``; the checkpoint must be quantized
  (``save_random_checkpoint(..., quantize=True)``) and is loaded the way the reference's
  convert.py prepares published weights: ``wo_a`` dequantized to bf16 (the reference computes it
  with a bf16 einsum), routed experts' int8 bytes read as ``float4_e2m1fn_x2``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import kernel_shims  # noqa: E402

# ModelArgs fields that have the same name and meaning in this repo's config.json.
SHARED_FIELDS = (
    "vocab_size", "dim", "moe_inter_dim", "n_layers", "n_hash_layers", "n_heads",
    "n_routed_experts", "n_shared_experts", "n_activated_experts", "score_func", "route_scale",
    "swiglu_limit", "q_lora_rank", "head_dim", "rope_head_dim", "norm_eps", "o_groups",
    "o_lora_rank", "window_size", "compress_rope_theta", "original_seq_len", "rope_theta",
    "rope_factor", "beta_fast", "beta_slow", "index_n_heads", "index_head_dim", "index_topk",
    "hc_mult", "hc_sinkhorn_iters", "hc_eps",
)
# --mode -> the reference's ModelArgs dtype and expert_dtype.
MODES = {"bf16": ("bf16", None), "fp8": ("fp8", "fp4")}


def import_reference(reference_dir: str, hadamard: str, sparse_mode: str):
    """The reference model module, its ``kernel`` and ``fast_hadamard_transform`` imports
    resolved to our shims. The source file is read, never modified."""
    kernel_shims.configure(hadamard=hadamard, sparse_attn_mode=sparse_mode)
    kernel_shims.install()
    ref = str(Path(reference_dir).resolve())
    sys.path.insert(0, ref)
    try:
        sys.modules.pop("model", None)
        model = importlib.import_module("model")
    finally:
        sys.path.remove(ref)
    if Path(model.__file__).resolve().parent != Path(ref):
        raise RuntimeError(f"imported {model.__file__}, not the reference's model.py")
    return model


def model_args(ref, cfg: dict, max_seq_len: int, mode: str = "bf16", max_batch_size: int = 1):
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
    fields = {f for f in ref.ModelArgs.__dataclass_fields__}
    kw = {k: cfg[k] for k in SHARED_FIELDS if k in cfg}
    missing = [k for k in SHARED_FIELDS if k in fields and k not in cfg]
    if missing:
        raise ValueError(f"checkpoint config lacks {missing}")
    n = cfg["n_layers"]
    kw["compress_ratios"] = tuple(cfg["compress_ratios"][:n])
    dtype, expert_dtype = MODES[mode]
    kw.update(max_batch_size=max_batch_size, max_seq_len=max_seq_len, n_mtp_layers=0,
              dtype=dtype, expert_dtype=expert_dtype, scale_dtype="fp8", scale_fmt="ue8m0")
    unknown = set(kw) - fields
    if unknown:
        raise ValueError(f"reference ModelArgs has no fields {sorted(unknown)}")
    return ref.ModelArgs(**kw)


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint's safetensors files, as stored."""
    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def read_checkpoint(path: Path, mode: str = "bf16") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as the reference loads them in ``mode``."""
    out = read_tensors(path)
    quantized = any(k.endswith(".scale") for k in out)
    if mode == "bf16" and quantized:
        raise ValueError("quantized checkpoint: write it with quantize=False for --mode bf16")
    if mode == "fp8":
        if not quantized:
            raise ValueError("unquantized checkpoint: write it with quantize=True for --mode fp8")
        as_converted(out)
    return out


def as_converted(tensors: dict[str, torch.Tensor]) -> None:
    """In place, what the reference's convert.py does to published weights (one process):
    ``*.wo_a.weight`` e4m3 times its 128x128 scale tile in fp32, rounded to bf16, its scale
    dropped; routed experts' int8 weights reinterpreted as float4_e2m1fn_x2 (same bytes)."""
    for name in [n for n in tensors if n.endswith(".wo_a.weight")]:
        w = tensors[name].float().unflatten(0, (-1, 128)).unflatten(-1, (-1, 128))
        s = tensors.pop(name[:-len("weight")] + "scale").float()
        tensors[name] = (w * s[:, None, :, None]).flatten(2, 3).flatten(0, 1).bfloat16()
    for name, t in tensors.items():
        if ".experts." in name and t.dtype == torch.int8:
            tensors[name] = t.view(torch.float4_e2m1fn_x2)


def load_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy each checkpoint tensor into the reference parameter of the same name, converted to
    the parameter's dtype (fp32 parameters stay fp32; tid2eid int64 -> int32). Every reference
    parameter must be covered, and no checkpoint tensor may be left over."""
    params = dict(model.named_parameters())
    left = set(tensors)
    for name, p in params.items():
        if name not in tensors:
            raise KeyError(f"checkpoint has no tensor for reference parameter {name}")
        t = tensors[name]
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"{name}: checkpoint {tuple(t.shape)} vs reference {tuple(p.shape)}")
        if t.is_floating_point() and p.is_floating_point() and t.dtype != p.dtype and not (
                t.dtype == torch.bfloat16 and p.dtype == torch.float32):
            raise ValueError(f"{name}: checkpoint {t.dtype} cannot go into {p.dtype} exactly")
        with torch.no_grad():
            p.copy_(t.to(p.dtype))
        left.discard(name)
    if left:
        raise KeyError(f"checkpoint tensors the reference does not have: {sorted(left)[:10]}")


def parse_tokens(spec: str, vocab: int) -> list[int]:
    if spec.startswith("random:"):
        _, n, seed = spec.split(":")
        g = torch.Generator().manual_seed(int(seed))
        return torch.randint(2, vocab, (int(n),), generator=g).tolist()
    if os.path.exists(spec):
        if spec.endswith(".pt"):
            return torch.load(spec).flatten().tolist()
        return [int(t) for t in json.loads(Path(spec).read_text())]
    return [int(t) for t in spec.split(",")]


def build(reference_dir: str, checkpoint: str, max_seq_len: int, hadamard: str = "cuda",
          sparse_mode: str = "tilelang", mode: str = "bf16", max_batch_size: int = 1):
    ref = import_reference(reference_dir, hadamard, sparse_mode)
    ckpt = Path(checkpoint)
    cfg = json.loads((ckpt / "config.json").read_text())
    args = model_args(ref, cfg, max_seq_len, mode, max_batch_size)
    torch.set_default_dtype(torch.bfloat16)
    torch.set_default_device("cpu")
    torch.manual_seed(0)
    model = ref.Transformer(args)
    load_weights(model, read_checkpoint(ckpt, mode))
    model.eval()
    return ref, model, args


def teacher_forced_logits(model, tokens: list[list[int]], prefill: int = 1, on_step=None
                          ) -> torch.Tensor:
    """tokens: one equal-length id list per batch row. A prefill of tokens[:, :prefill] at
    position 0, then one forced token per step -> fp32 logits [batch, len - prefill + 1, vocab]
    (row j: those computed at position prefill - 1 + j). on_step(i) after each pass, i = the
    last position it computed."""
    ids = torch.tensor(tokens, dtype=torch.long)
    if ids.dim() != 2 or not 1 <= prefill <= ids.size(1):
        raise ValueError(f"tokens must be equal-length lists and 1 <= prefill <= their length, "
                         f"got shape {tuple(ids.shape)}, prefill {prefill}")
    out = [model.forward(ids[:, :prefill], 0).float().clone()]
    if on_step is not None:
        on_step(prefill - 1)
    for i in range(prefill, ids.size(1)):
        out.append(model.forward(ids[:, i:i + 1], i).float().clone())
        if on_step is not None:
            on_step(i)
    return torch.stack(out, 1)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference-dir", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tokens", default="random:300:0")
    ap.add_argument("--out", default="ref_logits.safetensors")
    ap.add_argument("--max-seq-len", type=int, default=0, help="default: len(tokens) rounded up")
    ap.add_argument("--mode", choices=sorted(MODES), default="bf16",
                    help="the reference's dtype: bf16 (unquantized checkpoint) or fp8 (quantized)")
    ap.add_argument("--prefill", type=int, default=1, help="tokens of the first pass")
    ap.add_argument("--hadamard", choices=("cuda", "ref"), default="cuda")
    ap.add_argument("--sparse-attn", choices=("tilelang", "onepass"), default="tilelang")
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = json.loads((Path(a.checkpoint) / "config.json").read_text())
    tokens = parse_tokens(a.tokens, cfg["vocab_size"])
    max_seq_len = a.max_seq_len or max(512, -(-len(tokens) // 128) * 128)
    _, model, _ = build(a.reference_dir, a.checkpoint, max_seq_len, a.hadamard, a.sparse_attn,
                        a.mode)
    logits = teacher_forced_logits(model, [tokens], a.prefill)[0]
    save_file({"logits": logits.contiguous(), "tokens": torch.tensor(tokens, dtype=torch.int64)},
              a.out, metadata={"hadamard": a.hadamard, "sparse_attn": a.sparse_attn,
                               "mode": a.mode, "prefill": str(a.prefill),
                               "reference_dir": str(a.reference_dir)})
    print(f"wrote {a.out}: logits {tuple(logits.shape)} for {len(tokens)} tokens")


if __name__ == "__main__":
    main()
