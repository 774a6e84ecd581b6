"""Decode steps through SGLang 0.5.23's own monokernel dispatch, over SGLang's own KV pool.

What is SGLang's here: the weights pass through `monokernel_weights_iterator` (the spec's
load_tensor keeps them), `install_monokernel_forward` validates the spec on this rank, builds it
and wraps the model's forward, and every decode step is a `ForwardBatch` built as SGLang's
`init_new` builds one for decode, routed by the wrapped forward to our forward, which reads a
real `DeepSeekV4TokenToKVPool` and `ReqToTokenPool` through SGLang's forward context.

Stand-ins, each for something that needs a GPU or a launched server:
- the ISA (`binding.device_isa`) and the GPU's properties (compute units, current device);
- the TP group (one rank: `get_parallel().override(tp_group=...)`);
- SGLang's model object: `StandardPath`, a module holding SGLang's hf_config whose forward
  records the steps routed to SGLang's standard path (SGLang's DeepseekV4ForCausalLM does not
  run on a CPU);
- the attention backend in the forward context: an object holding the pool and the request
  table (SGLang's ROCm backend needs a GPU);
- the prefill: SGLang's prefill kernels need a GPU, so this project's model writes the prompts'
  KV into SGLang's pool through the same view, and then resets SGLang's state sentinel rows.

Compared with this project's model over its own pool, stepped as its engine steps (the same
checkpoint, prompts and tokens): the logits bit for bit, and every KV and state byte by
(request, position).
"""

import types

import pytest
import torch

from sglang_host import install_cpu_context, tp_ranks, use_stubs

use_stubs()
pytest.importorskip("sglang.kernels.plugin_kernels.amd.spec",
                    reason="SGLang 0.5.23 is not installed (see README)")

from dsv4.checkpoint import load_model, save_random_checkpoint  # noqa: E402
from dsv4.config import ModelConfig  # noqa: E402
from dsv4.graphs.emulation import EmulatedGraph, graph  # noqa: E402
from dsv4.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from dsv4.plugins import sglang_monokernel as mono  # noqa: E402
from dsv4.weights.loader import checkpoint_files  # noqa: E402
from sglang_mono_sides import (MAX_CTX, TORCH, assert_same_kv, extend_batch, our_side,  # noqa: E402
                               sglang_side)
from tiny_model import prompts  # noqa: E402


class StandardPath(torch.nn.Module):
    """Stand-in for SGLang's DeepseekV4ForCausalLM: its config, and a forward that records the
    steps SGLang's dispatch leaves to the standard path."""

    def __init__(self, hf_config):
        super().__init__()
        self.config = hf_config
        self.lm_head = torch.nn.Parameter(torch.zeros(1))   # where SGLang's weights live
        self.standard_steps = []

    def forward(self, input_ids, positions, forward_batch, input_embeds=None,
                pp_proxy_tensors=None):
        self.standard_steps.append(forward_batch.forward_mode)
        return "standard path"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_hf")
    config = ModelConfig.preset("tiny")
    config.original_seq_len = MAX_CTX      # the RoPE tables' length (max_position_embeddings)
    return save_random_checkpoint(config, path, naming="hf", quantize=False, seed=11)


@pytest.fixture(scope="module")
def hf_config(checkpoint):
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.server_args import ServerArgs

    install_cpu_context()
    sa = ServerArgs(model_path=str(checkpoint), device="cpu", dtype="bfloat16",
                    attention_backend="dsv4", kv_cache_dtype="fp8_e4m3")
    cfg = model_config_of(sa).hf_config
    # SGLang's request table is 4 columns wider than its context length (which is
    # max_position_embeddings by default): the tables here are MAX_CTX wide.
    cfg.max_position_embeddings = cfg.context_len = MAX_CTX - 4
    return cfg


@pytest.fixture
def sglang_runtime(monkeypatch, flag_env):
    """SGLang's runtime context with --enable-amd-monokernel, and the GPU stand-ins."""
    import sglang.kernels.plugin_kernels.amd.spec as spec_api
    import sglang.srt.kernel_plugins.amd.binding as binding
    from sglang.srt.runtime_context import get_context

    get_context().override_server_args(device="cpu", enable_amd_monokernel=True).install()
    monkeypatch.setattr(spec_api, "_REGISTRY", {})
    mono.register_spec()
    monkeypatch.setattr(binding, "device_isa", lambda: "gfx942")
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(multi_processor_count=304))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    flag_env(DSV4_KERNEL_BACKEND="torch")
    with tp_ranks():
        yield binding
    get_context().override_server_args(device="cpu").install()


def checkpoint_tensors(path):
    from safetensors import safe_open

    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def install(binding, checkpoint, hf_config):
    """SGLang's load path (the weights iterator) and install_monokernel_forward."""
    model = StandardPath(hf_config)
    for _ in binding.monokernel_weights_iterator(model=model,
                                                 weights=checkpoint_tensors(checkpoint)):
        pass
    binding.install_monokernel_forward(model=model, hf_config=hf_config, capture_tail_hooks=[])
    return model


def test_install_builds_the_spec_and_wraps_the_forward(sglang_runtime, checkpoint, hf_config):
    from sglang.kernels.plugin_kernels.amd.spec import ShapeKey, StepMetadata

    model = install(sglang_runtime, checkpoint, hf_config)
    served, unread = model._monokernel_unread_metadata
    assert served == {ShapeKey(forward_mode="decode", batch_size=b, tokens_per_request=1)
                      for b in range(1, 65)}
    assert unread == {StepMetadata.LOW_RATIO_DECODE_SCHEDULE}
    assert "_mono_copies" not in model.__dict__


class AttentionBackend:
    """Stand-in for SGLang's attention backend in the forward context: the pool and table it
    holds, and the decode backend's name."""

    decode_attention_backend_str = "dsv4"

    def __init__(self, pool, req_to_token_pool):
        self.token_to_kv_pool, self.req_to_token_pool = pool, req_to_token_pool


def sglang_decode_batch(ids, locs, side, pad_to=None):
    """A decode ForwardBatch as SGLang's init_new makes one (positions = seq_lens - 1); pad_to:
    padded rows as SGLang's graph runner pads (request 0, location 0, position 0, length 1)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    n = len(ids)
    pad = (pad_to or n) - n
    seq = torch.tensor(side.lens + [1] * pad)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=n + pad, input_ids=torch.tensor(ids + [0] * pad),
        req_pool_indices=torch.tensor(side.slots + [0] * pad), seq_lens=seq,
        out_cache_loc=torch.cat([locs.long(), torch.zeros(pad, dtype=torch.long)]),
        seq_lens_sum=int(seq.sum()), seq_lens_cpu=seq.clone(), positions=seq - 1,
        orig_seq_lens=seq.clone())


def padded_batch(width):
    """The static inputs SGLang's graph runner captures over: padded rows only."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    seq = torch.ones(width, dtype=torch.long)
    zeros = torch.zeros(width, dtype=torch.long)
    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=width, input_ids=zeros.clone(),
                        req_pool_indices=zeros.clone(), seq_lens=seq, out_cache_loc=zeros.clone(),
                        seq_lens_sum=width, seq_lens_cpu=seq.clone(), positions=zeros.clone(),
                        orig_seq_lens=seq.clone())


def engine_decode_batch(ids, locs, side):
    """The same step as this project's engine gives its model (its own ForwardBatch)."""
    lens = torch.tensor(side.lens)
    return ForwardBatch(ForwardMode.DECODE, torch.tensor(ids), lens - 1, locs.long(),
                        torch.tensor(side.slots), lens, max_seq_len=MAX_CTX)


def prefill(ours_model, side, prompt_lens, seed):
    """The prompts' KV written into the side's pool by this project's model (standing in for
    SGLang's prefill), then SGLang's state sentinel rows reset, as its pool keeps them."""
    ps = prompts(prompt_lens, seed)
    locs = side.take(prompt_lens)
    ours_model(extend_batch(ps, locs, side), side.pool, side.r2t, options=TORCH)
    if side.sglang:
        for layer, ratio in enumerate(ours_model.config.compress_ratios[:ours_model.config.n_layers]):
            if ratio:
                for table in ([side.pool.get_compressor_state(layer)]
                              + ([side.pool.get_indexer_compressor_state(layer)]
                                 if ratio == 4 else [])):
                    half = table.shape[-1] // 2
                    table[-1, :half], table[-1, half:] = 0.0, float("-inf")


@pytest.mark.parametrize("prompt_lens, steps", [([125], 5), ([120, 250, 61], 8)],
                         ids=["batch1", "batch3"])
def test_decode_steps_through_sglangs_dispatch_are_the_engines_bits(
        sglang_runtime, checkpoint, hf_config, prompt_lens, steps):
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    model = install(sglang_runtime, checkpoint, hf_config)
    reference = load_model(checkpoint, options=TORCH, weights="bf16")
    n = len(prompt_lens)
    ours, theirs = our_side(reference, n), sglang_side(reference, n)
    prefill(reference, ours, prompt_lens, seed=2)
    prefill(reference, theirs, prompt_lens, seed=2)
    backend = AttentionBackend(theirs.pool.pool, theirs.r2t_pool)
    g = torch.Generator().manual_seed(9)
    max_rows = reference.static_max_rows(MAX_CTX)
    for _ in range(steps):
        ids = torch.randint(2, reference.config.vocab_size, (n,), generator=g).tolist()
        want = reference(engine_decode_batch(ids, ours.grow(), ours), ours.pool, ours.r2t,
                         max_rows=max_rows, options=TORCH)
        batch = sglang_decode_batch(ids, theirs.grow(), theirs)
        with forward_context(ForwardContext(attn_backend=backend)):
            out = model.forward(batch.input_ids, batch.positions, batch)
        assert isinstance(out, LogitsProcessorOutput)
        got = out.next_token_logits
        assert got.dtype == torch.float32 and got.shape == (n, reference.config.vocab_size)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert model.standard_steps == []
    assert_same_kv(reference, ours, theirs)


def test_every_declared_width_captures_without_a_host_read(sglang_runtime, checkpoint,
                                                            hf_config):
    """Under this project's graph emulation (which refuses host reads and data-dependent
    shapes), SGLang's wrapped forward captures at every width the spec declares, as SGLang's
    graph runner captures: over static inputs holding padded rows only, after a warm-up run. At
    widths 1 and 3, the graph replayed over a live step (one request, the rest padded) gives the
    logits that step computes eagerly."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    model = install(sglang_runtime, checkpoint, hf_config)
    reference = load_model(checkpoint, options=TORCH, weights="bf16")
    side = sglang_side(reference, 1)
    prefill(reference, side, [130], seed=4)
    backend = AttentionBackend(side.pool.pool, side.r2t_pool)
    live = sglang_decode_batch([7], side.grow(), side, pad_to=3)
    with forward_context(ForwardContext(attn_backend=backend)):
        for width in mono.WIDTHS:
            static = padded_batch(width)
            model.forward(static.input_ids, static.positions, static)  # warm-up
            with graph(EmulatedGraph()) as g:
                out = model.forward(static.input_ids, static.positions, static)
            assert out.next_token_logits.shape == (width, reference.config.vocab_size)
            if width in (1, 3):
                for name in ("input_ids", "positions", "req_pool_indices", "seq_lens",
                             "out_cache_loc"):
                    getattr(static, name).copy_(getattr(live, name)[:width])
                g.replay()
                replayed = out.next_token_logits[:1].clone()
                eager = model.forward(static.input_ids, static.positions, static)
                assert torch.equal(replayed, eager.next_token_logits[:1])
    assert model.standard_steps == []


def test_bad_steps_are_refused_by_name(sglang_runtime, checkpoint, hf_config):
    from sglang.kernels.plugin_kernels.amd.spec import Plan, ShapeKey
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    install(sglang_runtime, checkpoint, hf_config)
    built = mono.SPEC.build  # the spec's build, called again for its object
    reference = load_model(checkpoint, options=TORCH, weights="bf16")
    side = sglang_side(reference, 1)
    prefill(reference, side, [20], seed=4)
    batch = sglang_decode_batch([7], side.grow(), side)
    copies = {}
    for name, t in checkpoint_tensors(checkpoint):
        mono.SPEC.load_tensor(copies, StandardPath(hf_config), name, t)
    from sglang.kernels.plugin_kernels.amd.spec import BuildContext

    kernels = built(StandardPath(hf_config), hf_config,
                    BuildContext(isa="gfx942", widths=(1,), deadline_s=5.0, copies=copies))
    key = ShapeKey(forward_mode="decode", batch_size=1, tokens_per_request=1)
    backend = AttentionBackend(side.pool.pool, side.r2t_pool)
    with forward_context(ForwardContext(attn_backend=backend)):
        with pytest.raises(ValueError, match="plan.key: this monokernel runs decode steps"):
            kernels.forward(Plan(key=ShapeKey(forward_mode="target_verify", batch_size=1,
                                              tokens_per_request=1)),
                            batch.input_ids, batch.positions, batch)
        with pytest.raises(ValueError, match="input_ids: 1 rows, plan.key.batch_size is 2"):
            kernels.forward(Plan(key=ShapeKey(forward_mode="decode", batch_size=2,
                                              tokens_per_request=1)),
                            batch.input_ids, batch.positions, batch)
        with pytest.raises(ValueError, match="input_embeds / pp_proxy_tensors"):
            kernels.forward(Plan(key=key), batch.input_ids, batch.positions, batch,
                            input_embeds=torch.zeros(1, 64))
        with pytest.raises(TypeError, match="get_embedding"):
            kernels.forward(Plan(key=key), batch.input_ids, batch.positions, batch,
                            get_embedding=True)
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        batch.capture_hidden_mode = CaptureHiddenMode.LAST
        with pytest.raises(ValueError, match="forward_batch.capture_hidden_mode: LAST"):
            kernels.forward(Plan(key=key), batch.input_ids, batch.positions, batch)
        batch.capture_hidden_mode = CaptureHiddenMode.NULL
        kernels.model.max_seq_len = MAX_CTX - 1
        with pytest.raises(ValueError, match=f"req_to_token: contexts of up to {MAX_CTX} "):
            kernels.forward(Plan(key=key), batch.input_ids, batch.positions, batch)
    with pytest.raises(ValueError, match="copies: no checkpoint tensor was kept at load"):
        built(StandardPath(hf_config), hf_config,
              BuildContext(isa="gfx942", widths=(1,), deadline_s=5.0, copies={}))


@pytest.fixture(scope="module")
def native_checkpoint(tmp_path_factory):
    """The small preset in the published formats (FP8 attention and shared expert, FP4 routed
    experts), Hugging Face names."""
    path = tmp_path_factory.mktemp("small_hf")
    config = ModelConfig.preset("small")
    config.original_seq_len = MAX_CTX
    return save_random_checkpoint(config, path, naming="hf", quantize=True, seed=12)


@pytest.mark.parametrize("dialect", ["ocp", "fnuz"])
def test_published_formats_through_sglangs_dispatch(sglang_runtime, native_checkpoint, flag_env,
                                                     dialect):
    """FP8/FP4 checkpoint tensors through load_tensor, held natively (on fnuz, the gfx942
    dialect, FP8 made fnuz with doubled scales): two decode steps give the bits this project's
    checkpoint loader's model gives over its own pool."""
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.server_args import ServerArgs

    from dsv4.options import Options

    flag_env(DSV4_KERNEL_BACKEND="torch", DSV4_FP8_DIALECT=dialect)
    sa = ServerArgs(model_path=str(native_checkpoint), device="cpu", dtype="bfloat16",
                    attention_backend="dsv4", kv_cache_dtype="fp8_e4m3")
    hf = model_config_of(sa).hf_config
    hf.max_position_embeddings = hf.context_len = MAX_CTX - 4      # as the hf_config fixture's
    model = install(sglang_runtime, native_checkpoint, hf)
    options = Options.from_env()
    reference = load_model(native_checkpoint, options=options)
    fp8 = {t.dtype for t in reference.state_dict().values() if t.dtype.is_floating_point
           and t.element_size() == 1 and t.dtype != torch.float8_e8m0fnu}
    assert reference.weights == "native"
    assert fp8 == {torch.float8_e4m3fnuz if dialect == "fnuz" else torch.float8_e4m3fn}
    ours, theirs = our_side(reference, 1), sglang_side(reference, 1)
    for side in (ours, theirs):
        prefill(reference, side, [130], seed=6)
    backend = AttentionBackend(theirs.pool.pool, theirs.r2t_pool)
    max_rows = reference.static_max_rows(MAX_CTX)
    for token in (5, 77):
        want = reference(engine_decode_batch([token], ours.grow(), ours), ours.pool, ours.r2t,
                         max_rows=max_rows, options=options)
        batch = sglang_decode_batch([token], theirs.grow(), theirs)
        with forward_context(ForwardContext(attn_backend=backend)):
            got = model.forward(batch.input_ids, batch.positions, batch).next_token_logits
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert_same_kv(reference, ours, theirs)


def test_a_tp_rank_builds_its_part_from_the_slices_it_kept(sglang_runtime, checkpoint,
                                                           hf_config):
    """Rank 1 of 2 (a stand-in TP group): the load hook keeps only the rank's slices and
    experts, and the model built from them equals the checkpoint loader's rank-1 model."""
    from dsv4.options import Options
    from dsv4.parallel import TensorSplit
    from dsv4.plugins import sglang_mono_weights as weights

    standard = StandardPath(hf_config)
    copies = {}
    with tp_ranks(1, 2):
        for name, t in checkpoint_tensors(checkpoint):
            weights.load_tensor(copies, standard, name, t)
        kept = sum(t.numel() for t in copies.values())
        split = weights.rank_split()
        built = weights.build_model(ModelConfig.from_json(checkpoint), "bf16", copies,
                                    torch.device("cpu"), 4096, Options.from_env(), split,
                                    standard)
    whole = sum(t.numel() for _, t in checkpoint_tensors(checkpoint))
    assert kept < whole
    want = load_model(checkpoint, options=Options.from_env(), weights="bf16",
                      split=TensorSplit(1, 2))
    got = built.state_dict()
    assert got.keys() == want.state_dict().keys()
    for name, t in want.state_dict().items():
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name


def test_a_server_whose_graphs_hold_no_declared_width_is_refused(sglang_runtime, checkpoint,
                                                                 hf_config, monkeypatch):
    """SGLang routes only the widths its decode graphs capture; graphs of 128 requests only
    (stand-in: SGLang's graph configuration) leave the spec no width, and SGLang says so."""
    from sglang.kernels.plugin_kernels.amd.spec import ShapeKey

    monkeypatch.setattr(sglang_runtime, "_capture_keys", lambda mode, tokens: [
        ShapeKey(forward_mode="decode", batch_size=128, tokens_per_request=1)])
    with pytest.raises(ValueError, match="dsv4-rocm has no width for this server's steps"):
        install(sglang_runtime, checkpoint, hf_config)


def test_sglang_aligns_its_decode_graphs_to_the_declared_widths():
    from sglang.srt.kernel_plugins.amd.binding import covered_capture_sizes

    sizes = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160]
    got = covered_capture_sizes(widths=mono.WIDTHS, tokens_per_request=1, sizes=sizes)
    assert got == list(range(1, 65)) + [80, 96, 128, 160]   # above 64: SGLang's own path
