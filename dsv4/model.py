"""The DeepSeek-V4 module tree (parameter names = the reference checkpoint's tensor names) and its
forward over the paged KV caches of ``mem_pool``.

One step (``DeepseekV4Model.forward``): attention metadata is built once from the batch (with the
pool's SWA translation of ``out_cache_loc``, once for all layers); then each
``DeepseekV4DecoderLayer`` runs, given that metadata and the step's ``Options``: mHC pre, its
``PagedAttention`` (Q/KV projections, the window KV store at the step's SWA write slots, the
compressors, the sparse attention over window + compressed rows: ``dsv4.paged_attention``), mHC
post, and the MoE half.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from hip_kernels.options import KernelOptions
from mem_pool.kv_cache_spec import STATE_RING

from .attention_metadata import AttentionMetadata, build_attention_metadata
from .config import ModelConfig
from .forward_batch import ForwardBatch
from .layers import mhc
from .layers.attention import Attention
from .layers.moe import MoE
from .layers.norm import RMSNorm
from .layers.rope import layer_freqs_cis
from .options import Options
from .paged_attention import PagedAttention, RingRowCapture
from .parallel import SINGLE, TensorSplit, split_problem
from .parallel.vocab import VocabEmbedding, VocabHead
from .weights.formats import native_problem

WEIGHT_FORMATS = ("native", "bf16")

logger = logging.getLogger(__name__)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype = torch.bfloat16,
                 device=None, native: bool = False, split: TensorSplit = SINGLE):
        super().__init__()
        self.layer_id = layer_id
        self.config = cfg
        self.compress_ratio = cfg.layer_ratio(layer_id)
        self.attn = Attention(cfg, layer_id, dtype, device, native, split)
        self.paged = PagedAttention(self.attn)   # not a submodule: it owns no parameters
        self.ffn = MoE(cfg, layer_id, dtype, device, native, split)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device)
        mix = (2 + cfg.hc_mult) * cfg.hc_mult
        hc_dim = cfg.hc_mult * cfg.dim
        for part in ("attn", "ffn"):
            self.register_parameter(f"hc_{part}_fn", _f32(device, mix, hc_dim))
            self.register_parameter(f"hc_{part}_base", _f32(device, mix))
            self.register_parameter(f"hc_{part}_scale", _f32(device, 3))

    def _hc_pre(self, x: torch.Tensor, part: str, options: Options, norm: RMSNorm | None = None):
        """mHC pre of the attn or ffn part; with norm (attn_norm / ffn_norm) the block input
        comes out normed, in the same op."""
        c = self.config
        return mhc.hc_pre(x, getattr(self, f"hc_{part}_fn"), getattr(self, f"hc_{part}_scale"),
                          getattr(self, f"hc_{part}_base"), c.norm_eps, c.hc_sinkhorn_iters,
                          c.hc_eps, reference=options.reference, kernel=options.kernel,
                          norm=norm)

    def attn_input(self, x: torch.Tensor, options: Options):
        """mHC pre + attn_norm: (y [N, dim], post, comb) from the hidden copies x [N, hc, dim]."""
        return self._hc_pre(x, "attn", options, self.attn_norm)

    def ffn_block(self, x: torch.Tensor, input_ids: torch.Tensor,
                  options: Options) -> torch.Tensor:
        """The whole FFN half: mHC pre, ffn_norm, MoE, mHC post."""
        y, post, comb = self._hc_pre(x, "ffn", options, self.ffn_norm)
        return mhc.hc_post(self.ffn(y, input_ids, options), x, post, comb, options.kernel)

    # ---- paged execution ----------------------------------------------------------------------

    def forward(self, x: torch.Tensor, batch: ForwardBatch, meta: AttentionMetadata,
                options: Options, token_to_kv_pool, freqs_cis: torch.Tensor,
                ring_capture: RingRowCapture | None = None) -> torch.Tensor:
        """Hidden copies [N, hc, dim] -> the same after this layer, computed with the step's
        options; freqs_cis: the layer's table."""
        y, post, comb = self.attn_input(x, options)
        out = self.paged(y, batch, meta, options, token_to_kv_pool, freqs_cis, ring_capture)
        x = mhc.hc_post(out, x, post, comb, options.kernel)
        return self.ffn_block(x, batch.input_ids, options)


class DeepseekV4Model(nn.Module):
    """options: what a forward computes with when its caller gives none (numerics, kernels,
    fused translation, multi-stream prepare); None reads the DSV4_* flags once, now, when the
    model is made (``Options.from_env()``): a flag changed later does not reach this model.

    weights: "native" holds the published checkpoints' formats and computes as the reference's
    FP8 mode: the attention projections (wq_a, wq_b, wkv, wo_b, the indexer's wq_b) and the
    shared expert FP8 with 128x128 ue8m0 scales (``layers.quant_linear.Fp8Linear``), the routed
    experts packed FP4 with 1x32 ue8m0 scales; wo_a, the embedding, gate, indexer weights_proj,
    compressors, norms, mHC and head as the reference keeps them (bf16 / fp32). "bf16": every
    linear in ``dtype`` (bf16 ``F.linear``). None: "native" where the config allows it (every
    FP8/FP4 linear's input dim a multiple of 128, ``weights.formats.native_problem``), else
    "bf16" (the tiny preset); asking "native" of a config that does not allow it raises.

    split: the part of the model this tensor-parallel rank holds (``dsv4.parallel``, the
    reference's model-parallel split: heads, output groups, routed experts, vocab rows), with
    the collectives on its group at the reference's points; default one rank, the whole model."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, device=None,
                 max_seq_len: int = 4096, options: Options | None = None,
                 weights: str | None = None, split: TensorSplit = SINGLE):
        super().__init__()
        config.validate()
        self.config = config
        self.split = split
        self.options = Options.from_env() if options is None else options
        self.dtype = dtype
        self.weights = resolve_weights(config, weights, dtype)
        native = self.weights == "native"
        problem = split_problem(config, split.size, native)
        if problem:
            raise ValueError(problem)
        self.max_seq_len = max_seq_len
        self.embed = VocabEmbedding(config.vocab_size, config.dim, dtype, device, split)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(config, i, dtype, device, native,
                                                           split)
                                    for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, device=device)
        self.head = VocabHead(config.vocab_size, config.dim, device, split)
        hc = config.hc_mult
        self.hc_head_fn = _f32(device, hc, hc * config.dim)
        self.hc_head_base = _f32(device, hc)
        self.hc_head_scale = _f32(device, 1)
        # RoPE tables (not in the checkpoint): rope_theta for ratio-0 layers, YaRN otherwise.
        self.register_buffer("freqs_cis", layer_freqs_cis(config, 0, max_seq_len, device),
                             persistent=False)
        self.register_buffer("freqs_cis_yarn", layer_freqs_cis(config, 4, max_seq_len, device),
                             persistent=False)

    def layer_freqs(self, layer: DeepseekV4DecoderLayer) -> torch.Tensor:
        return self.freqs_cis_yarn if layer.compress_ratio else self.freqs_cis

    def static_max_rows(self, max_context_len: int) -> dict[int, int]:
        """Compressed rows per query per ratio for a context bound: the fixed shapes a captured
        decode step needs (``forward(..., max_rows=...)``)."""
        return {r: -(-max_context_len // r) for r in self.compress_ratios()}

    def compress_ratios(self) -> dict[int, int]:
        """Compress ratio -> state ring size, for the ratios this model's layers use."""
        return {r: STATE_RING[r] for r in sorted({l.compress_ratio for l in self.layers}) if r}

    def whole_model_tensors(self) -> dict[str, torch.Tensor]:
        """The whole model's tensors by name, what a tensor-parallel rank's part is cut from:
        this model's own when it is not split, else those of the one-rank model of the same
        config and weight format on the meta device (names and whole shapes, no storage)."""
        if self.split.size == 1:
            return self.state_dict(keep_vars=True)
        whole = DeepseekV4Model(self.config, dtype=self.dtype, device="meta", max_seq_len=1,
                                weights=self.weights)
        return whole.state_dict(keep_vars=True)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, token_to_kv_pool, req_to_token: torch.Tensor,
                all_logits: bool = False, max_rows: dict[int, int] | None = None,
                options: Options | None = None,
                ring_capture: RingRowCapture | None = None) -> torch.Tensor:
        """One step over the paged caches: fp32 logits of each request's last new token [B, V]
        (of every new token [N, V] with all_logits). max_rows fixes the compressed rows per query
        per ratio (needed under graph capture; default: the batch's maximum). options: this
        step's (default: the model's). ring_capture (extend): the ratio-4 ring rows it names are
        handed back in its ``states``."""
        options = self.options if options is None else options
        swa_write_loc = (None if options.fused_swa_translate
                         else token_to_kv_pool.get_cached_swa_loc(batch.out_cache_loc))
        meta = build_attention_metadata(
            batch, req_to_token, token_to_kv_pool.full_to_swa_index_mapping, swa_write_loc,
            self.config.window_size, self.compress_ratios(), max_rows,
            ring_pages=token_to_kv_pool.state_ring_swa_page, kernel=options.kernel)
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(x, batch, meta, options, token_to_kv_pool, self.layer_freqs(layer),
                      ring_capture)
        if not all_logits and not batch.is_decode:
            x = x[torch.cumsum(batch.extend_seq_lens.long(), 0) - 1]
        return self.logits(x, options.kernel)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[N] token ids -> hidden copies [N, hc, dim]."""
        h = self.embed(input_ids.long())
        return h.unsqueeze(1).repeat(1, self.config.hc_mult, 1)

    def logits(self, x: torch.Tensor, kernel: KernelOptions) -> torch.Tensor:
        """Hidden copies [N, hc, dim] -> fp32 logits [N, vocab]; the mHC head and the final norm
        are one op on the step's kernel backend, as every mHC op and norm of the layers is."""
        c = self.config
        y = mhc.hc_head(x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, c.norm_eps,
                        c.hc_eps, norm=self.norm, kernel=kernel)
        return self.head(y.float())


def resolve_weights(config: ModelConfig, weights: str | None, dtype: torch.dtype) -> str:
    """The weight format a model of ``config`` holds: ``weights`` checked, or the default (see
    ``DeepseekV4Model``)."""
    problem = native_problem(config)
    if weights is None:
        return "bf16" if problem or dtype != torch.bfloat16 else "native"
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
    if weights == "native" and problem:
        raise ValueError(f"weights='native' is not possible: {problem}; use weights='bf16'")
    if weights == "native" and dtype != torch.bfloat16:
        raise ValueError(f"weights='native' computes in bf16 between the FP8 linears: dtype must "
                         f"be torch.bfloat16, got {dtype}")
    return weights


def _f32(device, *shape) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32, device=device))
