"""The DeepSeek-V4 module tree (parameter names = the reference checkpoint's tensor names) and the
storage-independent parts of its forward: embedding, mHC around each block, MoE, head.

Where the attention's KV lives and how a step is executed over the paged caches is in
``dsv4.paged`` (``DeepseekV4Model.forward(batch)``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from .config import ModelConfig
from .layers import mhc
from .layers.attention import Attention
from .layers.moe import MoE
from .layers.norm import RMSNorm

logger = logging.getLogger(__name__)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype = torch.bfloat16,
                 device=None):
        super().__init__()
        self.layer_id = layer_id
        self.config = cfg
        self.compress_ratio = cfg.layer_ratio(layer_id)
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


class DeepseekV4Model(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        config.validate()
        self.config = config
        self.dtype = dtype
        self.embed = nn.Embedding(config.vocab_size, config.dim, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(config, i, dtype, device)
                                    for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps, device=device)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False, dtype=torch.float32,
                              device=device)
        hc = config.hc_mult
        self.hc_head_fn = _f32(device, hc, hc * config.dim)
        self.hc_head_base = _f32(device, hc)
        self.hc_head_scale = _f32(device, 1)

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
