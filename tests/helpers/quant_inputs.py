"""Seeded inputs of the quantized-linear tests: bf16 activation rows over many magnitudes,
FP8 / FP4 weights and e8m0 block scales."""

import torch


def gen(seed):
    return torch.Generator().manual_seed(seed)


def rows(g, m, k, spread=True):
    """bf16 [m, k] rows whose 128-blocks span many magnitudes: tiny values (fp8 subnormals
    after scaling), zeros, large ones, a block of all zeros (amax floored at 1e-4)."""
    x = torch.randn(m, k, generator=g)
    if spread:
        x = x * torch.pow(2.0, torch.randint(-30, 12, (m, k), generator=g).float() / 3)
        x[:, :3] = 0
        if k >= 256:
            x[0, 128:256] = 0
    return x.bfloat16()


def fp8_weight(g, *shape):
    return (torch.randn(*shape, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)


def e8m0(g, *shape, lo=118, hi=130):
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.uint8).view(
        torch.float8_e8m0fnu)


def fp4_weight(g, *shape):
    return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
