"""Launches as a GPU would count them (scripts/gpu_launches.py, through
decode_launches.count_gpu_launches): each Triton launch plus each aten op outside one (views and
allocations aside), in every decoder layer and around them, for decode steps 3 and 4 of the tiny
preset at batch 2 (step 4 closes a ratio-4 compressor window), eager, the Triton backend under
its interpreter. So that docs and tests cannot claim fewer launches than a GPU would see."""

import pytest
import torch

pytest.importorskip("triton")

import bench_runner  # noqa: E402,F401  (puts scripts/ on sys.path)
import decode_launches  # noqa: E402
from gpu_launches import GpuLaunches  # noqa: E402
from dsv4.options import Options  # noqa: E402
from hip_kernels import KernelOptions  # noqa: E402
from hip_kernels.library import op  # noqa: E402
from hip_kernels.rms_norm import rms_norm_ref  # noqa: E402
from tiny_model import tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="counts the Triton interpreter's launches (a CPU run)")

BATCH, CONTEXT, STEPS = 2, 16, (3, 4)

# At most 32 launches in any decoder layer (measured: 17, 27 or 31 when the step closes a
# window, 19). Around them, what the step measures: attention_plan's two launches, hc_head's one
# (the mHC head and the final norm) and nine torch kernels (the embedding and its repeat, the
# logits' cast and GEMM, argmax, the table write and its cast, the SWA translation's index and
# cast). Held at that (the target is 30), so a new launch around the layers fails here.
LAYER_BUDGET = 32
OUTSIDE_BUDGET = 12
# The only aten op a decoder layer runs beside its Triton kernels: the bf16 linears' GEMMs. A
# new glue op fails here.
LAYER_ATEN_OPS = {"mm"}


@pytest.fixture(scope="module")
def counts():
    model = tiny_model(max_seq_len=CONTEXT + max(STEPS) + 2, seed=0)
    options = Options(graph=False, kernel=KernelOptions(backend="triton"))
    with torch.no_grad():
        found = decode_launches.decode_gpu_launches(model, BATCH, CONTEXT, options, STEPS)
    return model, found


@pytest.mark.parametrize("step", STEPS)
def test_every_decoder_layer_within_its_budget(counts, step):
    model, found = counts
    layers = found[step]["layers"]
    assert len(layers) == model.config.n_layers
    for i, layer in enumerate(layers):
        ratio = model.config.layer_ratio(i)
        assert layer.n_triton > 0, (i, layer.summary())      # the kernels are counted
        assert layer.total <= LAYER_BUDGET, (i, ratio, layer.summary())


@pytest.mark.parametrize("step", STEPS)
def test_a_layer_runs_no_other_aten_op(counts, step):
    _, found = counts
    for i, layer in enumerate(found[step]["layers"]):
        assert set(layer.aten) <= LAYER_ATEN_OPS, (i, layer.summary())


@pytest.mark.parametrize("step", STEPS)
def test_the_step_around_the_layers_within_its_budget(counts, step):
    _, found = counts
    outside = found[step]["outside"]
    assert outside.n_triton >= 2, outside.summary()       # attention_plan: one per ratio
    assert outside.total <= OUTSIDE_BUDGET, outside.summary()


def test_the_script_prints_a_row_per_layer_and_one_around_them(counts):
    model, found = counts
    kinds = [f"ratio {model.config.layer_ratio(i)}" for i in range(model.config.n_layers)]
    rows = decode_launches.launch_table(found, kinds).splitlines()
    assert len(rows) == 2 + model.config.n_layers + 1
    one = found[STEPS[0]]["layers"][1]
    assert rows[3].startswith(f"| layer 1 ({kinds[1]}) | {one.total} | {one.n_aten}: ")
    assert rows[-1].startswith(f"| outside the layers | {found[STEPS[0]]['outside'].total} | ")
    assert "--count" in bench_runner.script_help("decode_launches.py")


def test_a_dsv4_ops_body_counts_op_by_op():
    """A dispatcher op is not one launch: rms_norm's torch body run through its dsv4 op counts
    each of its kernels, as the body called directly does; its Triton body is one launch."""
    x, w = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(64)
    with GpuLaunches() as direct:
        rms_norm_ref(x, w, 1e-6)
    with GpuLaunches() as through_op:
        op("rms_norm", "torch")(x, w, 1e-6)
    with GpuLaunches() as kernel:
        op("rms_norm", "triton")(x, w, 1e-6)
    assert through_op.total.aten == direct.total.aten and direct.total.n_aten > 1
    assert (kernel.total.n_triton, kernel.total.aten) == (1, {})


def test_counting_leaves_the_values_alone():
    """grouped_out_proj's torch body rotates by a conj() view of the RoPE factors: counted, it
    gives the same bytes (a plain pass-through mode loses the conjugation)."""
    g = torch.Generator().manual_seed(0)
    o = torch.randn(6, 4, 128, generator=g).bfloat16()
    freqs = torch.polar(torch.ones(10, 32), torch.randn(10, 32, generator=g))   # the table
    positions = torch.tensor([7, 2, 9, 0, 4, 4])
    w = torch.randn(64, 256, generator=g).bfloat16()
    args = (o, freqs, positions, w, 2, 64)
    want = op("grouped_out_proj", "torch")(*args)
    with GpuLaunches() as counted:
        got = op("grouped_out_proj", "torch")(*args)
    assert torch.equal(got, want) and counted.total.n_aten > 1


def test_the_counter_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        with GpuLaunches():
            pass


def test_the_indexer_weights_are_a_triton_kernel_not_a_torch_gemm():
    """weights_proj, the one linear the checkpoint keeps in bf16 beside native FP8/FP4 weights,
    is one Triton launch on the Triton backend: a native layer runs no torch GEMM (its other
    linears are the FP8/FP4 kernels). On the torch backend it is F.linear's bits."""
    model = tiny_model(max_seq_len=8, seed=0)
    indexer = model.layers[1].attn.indexer
    x = torch.randn(2, model.config.dim).bfloat16()
    with GpuLaunches() as counted:
        w = indexer.head_weights(x, True, KernelOptions(backend="triton"))
    assert dict(counted.total.triton) == {"plain_linear_kernel": 1}
    assert not counted.total.aten, counted.total.summary()
    torch_w = indexer.head_weights(x, True, KernelOptions(backend="torch"))
    assert torch.equal(torch_w, torch.nn.functional.linear(x, indexer.weights_proj.weight))
    assert w.shape == torch_w.shape and w.dtype == torch_w.dtype
