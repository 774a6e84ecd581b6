"""The reference-logits fixtures in tests/data (written by scripts/reference_oracle/make_fixture.py,
one per CPU kernel set, see scripts/reference_oracle/cpu_kernel_set.py): their metadata, the one
made with this machine's torch and kernel set (or why there is none), the checkpoint digest they
record, and a one-line comparison of logits."""

import hashlib
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

DATA = Path(__file__).resolve().parents[1] / "data"
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "reference_oracle"))
try:
    import cpu_kernel_set
finally:
    sys.path.pop(0)


def fixture_meta(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def made_with(path: Path) -> dict[str, str]:
    """The torch version and CPU kernel set the fixture's metadata records."""
    meta = fixture_meta(path)
    missing = [k for k in ("torch", *cpu_kernel_set.KEYS) if k not in meta]
    if missing:
        raise KeyError(f"{path.name} lacks metadata {missing}: rerun "
                       "scripts/reference_oracle/make_fixture.py on the CPU it was made on")
    return {k: meta[k] for k in ("torch", *cpu_kernel_set.KEYS)}


def made_here() -> dict[str, str]:
    return {"torch": torch.__version__, **cpu_kernel_set.kernel_set()}


def kernel_label(path: Path) -> str:
    """How the fixture's file name is to end: its CPU kernel set, e.g. AVX512-GenuineIntel-amx."""
    return cpu_kernel_set.label(made_with(path))


def fixture_for_here(fixtures: list[Path]) -> Path | None:
    """The fixture made with this torch version on this CPU kernel set, if there is one."""
    here = made_here()
    for path in fixtures:
        if made_with(path) == here:
            return path
    return None


def skip_unless_fixture_here(fixtures: list[Path], rerun: str) -> None:
    """Skips the test unless one of the fixtures was made here, naming for each what differs
    from here (rerun: the make_fixture.py command that would write one here)."""
    if fixture_for_here(fixtures) is not None:
        return
    here = made_here()
    made = [f"{p.name} has " + ", ".join(f"{k} {v}" for k, v in made_with(p).items()
                                         if v != here[k]) for p in fixtures]
    pytest.skip(f"no fixture made with this torch and CPU kernel set: {'; '.join(made)}; here: "
                f"{', '.join(f'{k} {v}' for k, v in here.items())}: run {rerun} here to "
                "compare bits")


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
