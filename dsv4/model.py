"""The DeepSeek-V4 module tree (parameter names = the reference checkpoint's tensor names) and its
forward over the paged KV caches of ``mem_pool``.

One step (``DeepseekV4Model.forward``): attention metadata is built once from the batch; then each
``DeepseekV4DecoderLayer`` runs mHC pre, the attention prepare (Q/KV projections, the window KV
store at the SWA slots of ``out_cache_loc``, the compressors), the sparse attention over window +
compressed rows (``dsv4.paged_attention``), mHC post, and the MoE half.
"""

from __future__ import annotations

import logging
import weakref

import torch
from torch import nn

from hip_kernels import numerics

from . import envs, streams
from .attention_metadata import AttentionMetadata, build_attention_metadata
from .config import ModelConfig
from .forward_batch import ForwardBatch
from .layers import mhc
from .layers.attention import Attention
from .layers.linear import Linear
from .layers.moe import MoE
from .layers.norm import RMSNorm
from .layers.rope import layer_freqs_cis
from .paged_attention import (LayerCaches, attend, run_compressor, store_compressed,
                              store_index_keys)

logger = logging.getLogger(__name__)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype = torch.bfloat16,
                 device=None):
        super().__init__()
        self.layer_id = layer_id
        self.config = cfg
        self.compress_ratio = cfg.layer_ratio(layer_id)
        self._caches = None                  # (weakref to a pool, LayerCaches): _bound_caches
        self.attn = Attention(cfg, layer_id, dtype, device)
        self.ffn = MoE(cfg, layer_id, dtype, device)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, device=device)
        mix = (2 + cfg.hc_mult) * cfg.hc_mult
        hc_dim = cfg.hc_mult * cfg.dim
        for part in ("attn", "ffn"):
            self.register_parameter(f"hc_{part}_fn", _f32(device, mix, hc_dim))
            self.register_parameter(f"hc_{part}_base", _f32(device, mix))
            self.register_parameter(f"hc_{part}_scale", _f32(device, 3))

    def _hc_pre(self, x: torch.Tensor, part: str):
        c = self.config
        return mhc.hc_pre(x, getattr(self, f"hc_{part}_fn"), getattr(self, f"hc_{part}_scale"),
                          getattr(self, f"hc_{part}_base"), c.norm_eps, c.hc_sinkhorn_iters,
                          c.hc_eps)

    def attn_input(self, x: torch.Tensor):
        """mHC pre + attn_norm: (y [N, dim], post, comb) from the hidden copies x [N, hc, dim]."""
        y, post, comb = self._hc_pre(x, "attn")
        return self.attn_norm(y), post, comb

    def ffn_block(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The whole FFN half: mHC pre, ffn_norm, MoE, mHC post."""
        y, post, comb = self._hc_pre(x, "ffn")
        return mhc.hc_post(self.ffn(self.ffn_norm(y), input_ids), x, post, comb)

    # ---- paged execution ----------------------------------------------------------------------

    def forward(self, x: torch.Tensor, batch: ForwardBatch, meta: AttentionMetadata,
                token_to_kv_pool, freqs_cis: torch.Tensor, multi_stream: bool = False
                ) -> torch.Tensor:
        """Hidden copies [N, hc, dim] -> the same after this layer; freqs_cis: the layer's table."""
        y, post, comb = self.attn_input(x)
        freqs = freqs_cis[batch.positions.long()]
        caches = self._bound_caches(token_to_kv_pool)
        prepare = self._forward_prepare_multi_stream_hip if multi_stream else self._forward_prepare
        q, qr = prepare(y, batch, meta, token_to_kv_pool, caches, freqs_cis)
        out = attend(self.attn, q, qr, y, freqs, meta, caches, batch.is_decode)
        x = mhc.hc_post(out, x, post, comb)
        return self.ffn_block(x, batch.input_ids)

    def _bound_caches(self, pool) -> LayerCaches:
        """This layer's views of `pool` (LayerCaches), made when the layer first sees the pool
        and kept while it is the same pool (its buffers are allocated once): a step does not
        rebuild them (their state views are ops). Another pool rebinds them."""
        bound = self._caches
        if bound is None or bound[0]() is not pool:
            bound = (weakref.ref(pool), LayerCaches.of(pool, self.layer_id, self.compress_ratio))
            self._caches = bound
        return bound[1]

    def _project_q_store_kv(self, y, batch, token_to_kv_pool, freqs_cis):
        """(q, qr): Q projection; window KV norm + RoPE + FP8 store at the SWA slots of
        out_cache_loc, fused with q's weightless norm + RoPE (in place)."""
        q, qr = self.attn.project_q(y)
        kv = self.attn.project_kv(y)
        swa_loc = token_to_kv_pool.get_cached_swa_loc(batch.out_cache_loc, self.layer_id)
        token_to_kv_pool.set_swa_key_buffer_radix_fused_norm_rope(
            self.layer_id, swa_loc, kv, self.attn.kv_norm.weight, self.attn.eps, freqs_cis,
            batch.positions, q=q, numerics=numerics.store_numerics())
        return q, qr

    def _run_compressor(self, y, batch, meta, caches, freqs_cis):
        plan = meta.plans[self.compress_ratio]
        new = run_compressor(self.attn.compressor, y, batch.positions, plan, caches.state,
                             store_compressed(caches), freqs_cis)
        if self.compress_ratio == 4:
            self._capture_state(batch, "compressor_state", new)

    def _run_indexer_compressor(self, y, batch, meta, caches, freqs_cis):
        new = run_compressor(self.attn.indexer.compressor, y, batch.positions, meta.plans[4],
                             caches.index_state, store_index_keys(caches), freqs_cis)
        self._capture_state(batch, "indexer_compressor_state", new)

    def _capture_state(self, batch: ForwardBatch, table: str, new: torch.Tensor) -> None:
        """Hand back the ratio-4 ring rows the caller asked for (batch.capture_state_rows)."""
        if batch.capture_state_rows is None:
            return
        if batch.captured_states is None:
            batch.captured_states = {}
        batch.captured_states.setdefault(table, {})[self.layer_id] = (
            new[batch.capture_state_rows].clone())

    def _forward_prepare(self, y, batch, meta, token_to_kv_pool, caches, freqs_cis):
        """Everything on the current stream: Q, window KV store, compressors. (q, qr)."""
        q, qr = self._project_q_store_kv(y, batch, token_to_kv_pool, freqs_cis)
        if self.compress_ratio:
            self._run_compressor(y, batch, meta, caches, freqs_cis)
        if self.attn.indexer is not None:
            self._run_indexer_compressor(y, batch, meta, caches, freqs_cis)
        return q, qr

    def _forward_prepare_multi_stream_hip(self, y, batch, meta, token_to_kv_pool, caches,
                                          freqs_cis):
        """The compressors on side streams, Q/KV and the window store on the main stream, joined
        before the indexer scoring and the attention. Same results as _forward_prepare."""
        main = streams.current_stream(y.device)
        side = self._side_streams(y.device)
        for s in side:
            s.wait_stream(main)                       # y is ready
        if self.compress_ratio:
            with streams.on_stream(side[0]):
                self._run_compressor(y, batch, meta, caches, freqs_cis)
        if self.attn.indexer is not None:
            with streams.on_stream(side[1]):
                self._run_indexer_compressor(y, batch, meta, caches, freqs_cis)
        q, qr = self._project_q_store_kv(y, batch, token_to_kv_pool, freqs_cis)
        for s in side:
            main.wait_stream(s)
        return q, qr

    def _side_streams(self, device):
        if getattr(self, "_streams", None) is None:
            self._streams = (streams.new_stream(device), streams.new_stream(device))
        return self._streams


class DeepseekV4Model(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, device=None,
                 max_seq_len: int = 4096):
        super().__init__()
        config.validate()
        self.config = config
        self.dtype = dtype
        self.max_seq_len = max_seq_len
        self.embed = nn.Embedding(config.vocab_size, config.dim, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(config, i, dtype, device)
                                    for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, device=device)
        self.head = Linear(config.dim, config.vocab_size, dtype=torch.float32, device=device)
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
        return {r: 2 * r if r == 4 else r for r in sorted({l.compress_ratio for l in self.layers})
                if r}

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, token_to_kv_pool, req_to_token: torch.Tensor,
                all_logits: bool = False, max_rows: dict[int, int] | None = None,
                multi_stream: bool | None = None) -> torch.Tensor:
        """One step over the paged caches: fp32 logits of each request's last new token [B, V]
        (of every new token [N, V] with all_logits). max_rows fixes the compressed rows per query
        per ratio (needed under graph capture; default: the batch's maximum)."""
        if multi_stream is None:
            multi_stream = envs.MULTI_STREAM_PREPARE.get()
        meta = build_attention_metadata(
            batch, req_to_token, token_to_kv_pool.full_to_swa_index_mapping,
            self.config.window_size, self.compress_ratios(), max_rows)
        x = self.embed_tokens(batch.input_ids)
        for layer in self.layers:
            x = layer(x, batch, meta, token_to_kv_pool, self.layer_freqs(layer), multi_stream)
        if not all_logits and not batch.is_decode:
            x = x[torch.cumsum(batch.extend_seq_lens.long(), 0) - 1]
        return self.logits(x)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[N] token ids -> hidden copies [N, hc, dim]."""
        h = self.embed(input_ids.long())
        return h.unsqueeze(1).repeat(1, self.config.hc_mult, 1)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Hidden copies [N, hc, dim] -> fp32 logits [N, vocab]."""
        c = self.config
        y = mhc.hc_head(x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, c.norm_eps,
                        c.hc_eps)
        return self.head(self.norm(y).float())


def _f32(device, *shape) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32, device=device))
