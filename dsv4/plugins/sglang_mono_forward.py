"""The monokernel's build and forward: this project's decode step in place of SGLang's.

`build(model, hf_config, context)` (the spec's build, run by SGLang's
`install_monokernel_forward` after the weights loaded and before the KV pool exists) builds this
project's model over SGLang's loaded parameters where it reads them in place, and from the load
hook's copies elsewhere (`sglang_mono_weights`). `DecodeMonokernel.forward`
then runs each covered decode step: SGLang's dispatcher calls it with `Plan(key)` and the model
forward's own arguments `(input_ids, positions, forward_batch)`. It reads SGLang's KV pool and
request table through the forward context (`get_token_to_kv_pool()`, `get_req_to_token_pool()`),
runs the decoder over them (`sglang_mono_pool.SGLangMonoPool`: SGLang's buffers, written in place
in SGLang's layout), and returns SGLang's `LogitsProcessorOutput` with fp32 logits [rows, vocab].

It is capturable: its shapes follow the plan's batch size and the request table's width (the
compressed rows per query are sized for the longest context the table holds), and it reads
nothing back to the host; SGLang's padded rows (request 0, location 0, position 0, length 1)
write only SGLang's dummy page and slot, as SGLang's own path does.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..forward_batch import ForwardBatch, ForwardMode
from ..options import Options
from .sglang_mono_config import hf_dict, model_config
from .sglang_mono_pool import SGLangMonoPool
from .sglang_mono_weights import build_model, max_seq_len, rank_split, weight_format

logger = logging.getLogger(__name__)


class DecodeMonokernel:
    """What the spec's build returns: `forward(plan, input_ids, positions, forward_batch)`."""

    def __init__(self, model, options: Options):
        self.model = model
        self.options = options
        self._views: dict[int, SGLangMonoPool] = {}

    def pool_view(self, pool) -> SGLangMonoPool:
        """The view of SGLang's pool, made once per pool object (the layers keep views of the
        buffers of the pool object they are given)."""
        view = self._views.get(id(pool))
        if view is None or view.pool is not pool:
            c = self.model.config
            view = self._views[id(pool)] = SGLangMonoPool(pool, c.compress_ratios[:c.n_layers])
        return view

    @torch.no_grad()
    def forward(self, plan, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch,
                input_embeds: Any = None, pp_proxy_tensors: Any = None):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.model_executor.forward_context import (get_req_to_token_pool,
                                                               get_token_to_kv_pool)

        key = plan.key
        if key.forward_mode != "decode" or key.tokens_per_request != 1:
            raise ValueError(f"plan.key: this monokernel runs decode steps of one token a "
                             f"request, got {key}")
        if input_ids.shape[0] != key.batch_size:
            raise ValueError(f"input_ids: {input_ids.shape[0]} rows, plan.key.batch_size is "
                             f"{key.batch_size}")
        if input_embeds is not None or pp_proxy_tensors is not None:
            raise ValueError("input_embeds / pp_proxy_tensors: not supported by this monokernel "
                             "(token ids only, one pipeline stage)")
        capture = getattr(forward_batch, "capture_hidden_mode", None)
        if capture is not None and capture.need_capture():
            raise ValueError(f"forward_batch.capture_hidden_mode: {capture.name} asks for hidden "
                             "states; this monokernel returns logits only")
        req_to_token = get_req_to_token_pool().req_to_token
        context = req_to_token.shape[1]
        if context > self.model.max_seq_len:
            raise ValueError(f"req_to_token: contexts of up to {context} tokens; this model's "
                             f"RoPE tables hold {self.model.max_seq_len} positions")
        batch = ForwardBatch(ForwardMode.DECODE, input_ids, positions,
                             forward_batch.out_cache_loc, forward_batch.req_pool_indices,
                             forward_batch.seq_lens, max_seq_len=context)
        logits = self.model.forward(batch, self.pool_view(get_token_to_kv_pool()), req_to_token,
                                    max_rows=self.model.static_max_rows(context),
                                    options=self.options)
        return LogitsProcessorOutput(next_token_logits=logits)


def _device_of(model: torch.nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cuda", torch.cuda.current_device())


def build(model: torch.nn.Module, hf_config: Any, context: Any) -> DecodeMonokernel:
    """The spec's build: this rank's model from the load hook's copies (the DSV4_* flags read
    now, once), on SGLang's model's device."""
    options = Options.from_env()
    config = model_config(hf_config)
    hf = hf_dict(hf_config)
    ours = build_model(config, weight_format(hf), context.copies, _device_of(model),
                       max_seq_len(hf, config), options, rank_split(), model)
    logger.info("dsv4-rocm monokernel built on %s: %s weights, widths %s", context.isa,
                ours.weights, list(context.widths))
    return DecodeMonokernel(ours, options)
