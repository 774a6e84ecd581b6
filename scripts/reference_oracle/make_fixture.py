"""Write tests/data/reference_logits_<tiny|fp8>_<CPU kernel set>.safetensors: the reference
inference code's teacher-forced logits on a random checkpoint this repository generates, as this
machine's torch computes them (one fixture per CPU kernel set, ``cpu_kernel_set``: torch's
vector capability, the CPU vendor MKL dispatches by, the kernels of bf16 matmuls).

    python scripts/reference_oracle/make_fixture.py --reference-dir PATH/TO/inference \\
        [--mode fp8]

PATH/TO/inference is the ``inference/`` folder published with the DeepSeek-V4 weights (its
``model.py``; the TileLang ``kernel.py`` and the CUDA Hadamard extension are replaced on a CPU by
``kernel_shims``). Nothing of it is copied here: the fixture holds only token ids, logits and
digests. Steps:

1. ``save_random_checkpoint(ModelConfig.preset("tiny"), DIR, seed=--seed, quantize=False)``
   (reference names, unquantized weights), into a temporary directory;
2. ``run_reference``'s teacher-forced decode of --tokens on it (1-token prefill, then one token
   per step), logits fp32 [len(tokens), vocab];
3. the fixture: ``logits``, ``tokens``, and metadata: the checkpoint seed, preset, a SHA-256 of
   the checkpoint's tensors (``checkpoint_digest``, which the test recomputes, so a change in the
   random initialisation is reported as such and not as a numerics failure), the SHA-256 of the
   reference's model.py, the shim modes, and the torch version and CPU kernel set
   (``cpu_kernel_set.kernel_set()``, one metadata key each): bits are the same only where both
   are.

tests/model/test_numerics_reference.py replays the same tokens through this repo's engine (eager,
default flags) and requires the logits to be equal bit for bit.

--mode fp8 (fixture ``reference_logits_fp8_<CPU kernel set>``, tested by
tests/model/test_numerics_reference_fp8.py): the reference in its published FP8 mode (run_reference.py)
on ``save_random_checkpoint(fp8_config(), DIR, seed, quantize=True)``: FP8 linears with 128x128
scales, FP4 routed experts. ``fp8_config()`` is the tiny preset widened so that every quantized
linear's input dim is a multiple of 128 (the reference's ``act_quant`` asserts it); the fixture
stores it as JSON (metadata ``config``). Two cases: ``logits``/``tokens`` as above (batch 1, a
1-token prefill, then decode), and ``extend_logits`` [2, --extend-decode + 1, vocab] /
``extend_tokens`` [2, --extend-prefill + --extend-decode]: a batch of two prompts prefilled
together (--extend-prefill tokens each), then decoded together, one forced token per step; and
``short_logits`` / ``short_tokens``, the same with prompts shorter than the 128-token window
(--short-prefill, --short-decode): the reference then passes min(L, window) window columns in the
prefill, so its compressed rows start in an earlier 64-row block.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import run_reference as refdrv  # noqa: E402
from cpu_kernel_set import kernel_set, label  # noqa: E402

FIXTURE_DIR = ROOT / "tests" / "data"


def default_fixture(mode: str = "bf16") -> Path:
    """The fixture of ``mode`` for this machine's CPU kernel set (``cpu_kernel_set.label``)."""
    name = f"reference_logits_{'tiny' if mode == 'bf16' else mode}_{label(kernel_set())}"
    return FIXTURE_DIR / f"{name}.safetensors"


def fp8_config():
    """The ``small`` preset: the tiny preset with every quantized linear's input dim a multiple of
    128 (dim 256, q_lora_rank 128, moe_inter_dim 128, 4 output groups of rank 128; 4 heads of 512
    and the indexer's 128 as in tiny)."""
    from dsv4.config import ModelConfig

    return ModelConfig.preset("small")


def checkpoint_digest(path: Path) -> str:
    """SHA-256 over the checkpoint's tensors, by name, in sorted order (names, dtypes, shapes
    and bytes): independent of how they are sharded."""
    h = hashlib.sha256()
    tensors = refdrv.read_tensors(Path(path))
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def reference_logits(reference_dir: str, ckpt: Path, mode: str, tokens: list[list[int]],
                     prefill: int) -> torch.Tensor:
    """The reference's teacher-forced logits [batch, len - prefill + 1, vocab], on a model built
    for this batch (a fresh one: the reference keeps its caches in the model)."""
    max_seq_len = max(512, -(-len(tokens[0]) // 128) * 128)
    _, model, _ = refdrv.build(reference_dir, str(ckpt), max_seq_len, mode=mode,
                               max_batch_size=len(tokens))
    return refdrv.teacher_forced_logits(model, tokens, prefill)


def main(argv=None) -> None:
    from dsv4.checkpoint import save_random_checkpoint
    from dsv4.config import ModelConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference-dir", required=True, help="the reference's inference/ folder")
    ap.add_argument("--mode", choices=sorted(refdrv.MODES), default="bf16",
                    help="bf16: tiny preset, unquantized; fp8: fp8_config(), quantized")
    ap.add_argument("--seed", type=int, default=0, help="checkpoint seed (default 0)")
    ap.add_argument("--tokens", default=None, help="token ids, as run_reference takes them "
                    "(default random:200:0, with --mode fp8 random:140:0)")
    ap.add_argument("--extend-prefill", type=int, default=130,
                    help="--mode fp8: prompt length of the batch-2 case (default 130)")
    ap.add_argument("--extend-decode", type=int, default=10,
                    help="--mode fp8: decode steps of the batch-2 case (default 10)")
    ap.add_argument("--short-prefill", type=int, default=40,
                    help="--mode fp8: prompt length of the batch-2 short-prompt case (default 40)")
    ap.add_argument("--short-decode", type=int, default=24,
                    help="--mode fp8: decode steps of the short-prompt case (default 24)")
    ap.add_argument("--out", default=None,
                    help="default: tests/data/reference_logits_<tiny|fp8>_<CPU kernel set>"
                         ".safetensors")
    a = ap.parse_args(argv)
    fp8 = a.mode == "fp8"
    tokens_spec = a.tokens or ("random:140:0" if fp8 else "random:200:0")
    torch.set_num_threads(1)
    cfg = fp8_config() if fp8 else ModelConfig.preset("tiny")
    tokens = refdrv.parse_tokens(tokens_spec, cfg.vocab_size)
    tensors = {"tokens": torch.tensor(tokens, dtype=torch.int64)}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_random_checkpoint(cfg, Path(tmp) / "ckpt", seed=a.seed, quantize=fp8)
        tensors["logits"] = reference_logits(a.reference_dir, ckpt, a.mode, [tokens], 1)[0]
        if fp8:
            for case, prefill, decode in (("extend", a.extend_prefill, a.extend_decode),
                                          ("short", a.short_prefill, a.short_decode)):
                rows = [refdrv.parse_tokens(f"random:{prefill + decode}:{a.seed + 1 + b}",
                                            cfg.vocab_size) for b in range(2)]
                tensors[f"{case}_tokens"] = torch.tensor(rows, dtype=torch.int64)
                tensors[f"{case}_logits"] = reference_logits(a.reference_dir, ckpt, a.mode, rows,
                                                             prefill)
        digest = checkpoint_digest(ckpt)
    model_py = Path(a.reference_dir) / "model.py"
    meta = {"preset": "" if fp8 else "tiny", "checkpoint_seed": str(a.seed),
            "checkpoint_digest": digest, "tokens": tokens_spec, "reference_model_py_sha256":
                hashlib.sha256(model_py.read_bytes()).hexdigest(),
            "hadamard": "cuda", "sparse_attn": "tilelang", "torch": torch.__version__,
            **kernel_set()}
    if fp8:
        meta.update(mode="fp8", quantize="1", config=json.dumps(cfg.to_dict()),
                    extend_prefill=str(a.extend_prefill), short_prefill=str(a.short_prefill))
    out = Path(a.out or default_fixture(a.mode))
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(out), metadata=meta)
    shapes = ", ".join(f"{k} {tuple(t.shape)}" for k, t in tensors.items())
    print(f"wrote {out}: {shapes}, checkpoint digest {digest[:16]}...")


if __name__ == "__main__":
    main()
