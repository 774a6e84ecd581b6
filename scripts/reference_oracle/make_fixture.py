"""Write tests/data/reference_logits_tiny_<CPU kernel set>.safetensors: the reference inference
code's teacher-forced logits on a random tiny checkpoint this repository generates, as this
machine's torch computes them (one fixture per CPU kernel set, e.g. AVX512 and AVX2).

    python scripts/reference_oracle/make_fixture.py --reference-dir PATH/TO/inference

PATH/TO/inference is the ``inference/`` folder published with the DeepSeek-V4 weights (its
``model.py``; the TileLang ``kernel.py`` and the CUDA Hadamard extension are replaced on a CPU by
``kernel_shims``). Nothing of it is copied here: the fixture holds only token ids, logits and
digests. Steps:

1. ``save_random_checkpoint(ModelConfig.preset("tiny"), DIR, seed=--seed)`` (reference names,
   unquantized weights), into a temporary directory;
2. ``run_reference``'s teacher-forced decode of --tokens on it (1-token prefill, then one token
   per step), logits fp32 [len(tokens), vocab];
3. the fixture: ``logits``, ``tokens``, and metadata: the checkpoint seed, preset, a SHA-256 of
   the checkpoint's tensors (``checkpoint_digest``, which the test recomputes, so a change in the
   random initialisation is reported as such and not as a numerics failure), the SHA-256 of the
   reference's model.py, the shim modes, and the torch version and CPU kernel set
   (``torch.backends.cpu.get_cpu_capability()``): bits are the same only where both are.

tests/test_numerics_reference.py replays the same tokens through this repo's engine (eager,
default flags) and requires the logits to be equal bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import run_reference as refdrv  # noqa: E402

FIXTURE_DIR = ROOT / "tests" / "data"


def default_fixture() -> Path:
    """The fixture for this machine's CPU kernel set (torch's get_cpu_capability())."""
    cap = torch.backends.cpu.get_cpu_capability()
    return FIXTURE_DIR / f"reference_logits_tiny_{cap}.safetensors"


def checkpoint_digest(path: Path) -> str:
    """SHA-256 over the checkpoint's tensors, by name, in sorted order (names, dtypes, shapes
    and bytes): independent of how they are sharded."""
    h = hashlib.sha256()
    tensors = refdrv.read_checkpoint(Path(path))
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main(argv=None) -> None:
    from dsv4.checkpoint import save_random_checkpoint
    from dsv4.config import ModelConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference-dir", required=True, help="the reference's inference/ folder")
    ap.add_argument("--seed", type=int, default=0, help="checkpoint seed (default 0)")
    ap.add_argument("--tokens", default="random:200:0",
                    help="token ids, as run_reference takes them (default random:200:0)")
    ap.add_argument("--out", default=str(default_fixture()),
                    help="default: tests/data/reference_logits_tiny_<CPU kernel set>.safetensors")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = save_random_checkpoint(ModelConfig.preset("tiny"), Path(tmp) / "ckpt", seed=a.seed)
        cfg = ModelConfig.preset("tiny")
        tokens = refdrv.parse_tokens(a.tokens, cfg.vocab_size)
        max_seq_len = max(512, -(-len(tokens) // 128) * 128)
        _, model, _ = refdrv.build(a.reference_dir, str(ckpt), max_seq_len)
        logits = refdrv.teacher_forced_logits(model, tokens)
        digest = checkpoint_digest(ckpt)
    model_py = Path(a.reference_dir) / "model.py"
    meta = {"preset": "tiny", "checkpoint_seed": str(a.seed), "checkpoint_digest": digest,
            "tokens": a.tokens, "reference_model_py_sha256":
                hashlib.sha256(model_py.read_bytes()).hexdigest(),
            "hadamard": "cuda", "sparse_attn": "tilelang", "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file({"logits": logits.contiguous(), "tokens": torch.tensor(tokens, dtype=torch.int64)},
              str(out), metadata=meta)
    print(f"wrote {out}: logits {tuple(logits.shape)}, checkpoint digest {digest[:16]}...")


if __name__ == "__main__":
    main()
