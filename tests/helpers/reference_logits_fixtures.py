"""The reference-logits fixtures in tests/data (written by scripts/reference_oracle/make_fixture.py,
one per CPU kernel set): their metadata, the one made with this machine's torch and kernel set,
the checkpoint digest they record, and a one-line comparison of logits."""

import hashlib
from pathlib import Path

import torch
from safetensors import safe_open

DATA = Path(__file__).resolve().parents[1] / "data"


def fixture_meta(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def fixture_for_here(fixtures: list[Path]) -> Path | None:
    """The fixture made with this torch version on this CPU kernel set, if there is one."""
    here = (torch.__version__, torch.backends.cpu.get_cpu_capability())
    for path in fixtures:
        meta = fixture_meta(path)
        if (meta["torch"], meta["cpu_capability"]) == here:
            return path
    return None


def checkpoint_digest(path: Path) -> str:
    """The fixture script's digest: SHA-256 over (name, dtype, shape, bytes) of every stored
    tensor, names sorted."""
    tensors = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def report(got: torch.Tensor, want: torch.Tensor) -> str:
    """Logits [..., vocab], compared row by row (rows in order, batch rows one after another)."""
    got, want = got.flatten(0, -2), want.flatten(0, -2)
    same = (got == want).all(-1)
    cos = torch.nn.functional.cosine_similarity(got.double(), want.double(), dim=-1)
    agree = (got.argmax(-1) == want.argmax(-1)).float().mean()
    return (f"{int(same.sum())}/{len(same)} steps bit-identical, first differing step "
            f"{int((~same).nonzero()[0]) if not same.all() else None}, max |diff| "
            f"{(got - want).abs().max().item():.4g}, mean cosine {cos.mean().item():.5f}, worst "
            f"{cos.min().item():.5f}, argmax agreement {agree.item():.3f}")
