"""The quantized linears on NVIDIA targets: the Triton kernels compile for sm_90 to matrix-core
instructions (no GPU needed), and on a GPU their output stays within the summation bound of the
torch reference (the matrix cores sum a block's products in their own fp32 order: one bf16 ulp
plus 2^-12 of the sum of the absolute dequantized products). The AMD targets are in
test_triton_aot's report."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from hip_kernels import KernelOptions, act_quant, fp8_linear  # noqa: E402
from hip_kernels import quant_linear_ref as R  # noqa: E402
from quant_inputs import e8m0, fp8_weight, gen, rows  # noqa: E402

TORCH = KernelOptions(backend="torch")
TRITON = KernelOptions(backend="triton")


SM90_COMPILE = """
import json, re
from hip_kernels.platform import OCP
from hip_kernels.triton_aot import _variants, compile_for
rows = {}
for name, (kernel, sig, cex, *opts) in _variants(OCP).items():
    if "linear" in name:
        ptx = compile_for(kernel, sig, cex, "sm_90", *opts).asm["ptx"]
        rows[name] = sorted(set(re.findall(r"(?:mma[.]sync|wgmma[.]mma_async)[.]\\S+", ptx)))
print(json.dumps(rows))
"""


def test_kernels_compile_for_cuda_sm90():
    """The AMD targets are in test_triton_aot's report; NVIDIA H100 (sm_90) here: both kernels
    compile (ptx and cubin) to matrix-core instructions (16 rows: mma.sync on f16/bf16
    operands, exact for fp8 and e2m1 values; 64 rows: fp8 wgmma)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", SM90_COMPILE], cwd=Path(__file__).parents[2],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)
    assert set(rows) == {"fp8_linear (16 rows)", "fp8_linear (64 rows)",
                         "fp4_grouped_linear (16 rows)"}
    assert all(rows.values()), rows


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64])
def test_gpu_kernels_within_the_summation_bound(m):
    """On a GPU the blocks' products are summed by the matrix cores in their own order."""
    g = gen(11)
    x = rows(g, m, 1024, spread=False)
    w, ws = fp8_weight(g, 512, 1024), e8m0(g, 4, 8)
    want = fp8_linear(x, w, ws, kernel=TORCH).double()
    got = fp8_linear(x.cuda(), w.cuda(), ws.cuda(), kernel=TRITON).cpu().double()
    q, s = act_quant(x)
    a = (q.double().unflatten(-1, (-1, 128)) * s.double()[..., None]).flatten(-2)
    b = R.e8m0_to_float(ws).double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    size = a.abs() @ (w.double() * b).abs().T
    ulp = torch.pow(2.0, torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)
    assert ((got - want).abs() <= ulp + size * 2.0 ** -12).all()
    assert math.isfinite(float(got.abs().max()))
