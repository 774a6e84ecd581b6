"""A small batch-synchronous engine: prefill the prompts into the paged pools, then decode.

``Engine(model, max_total_tokens=...)`` owns the KV pool and allocator (``mem_pool``) and the
request -> token table; ``generate`` admits every prompt, runs one extend step over all of them,
then one decode step per new token (greedy, or the ``forced_tokens`` given), and frees everything.
SWA pages that leave the window are released after every step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from mem_pool.dsv4_pool import create_dsv4_kv_cache
from mem_pool.kv_cache_spec import KVCacheSpec

from .forward_batch import ForwardBatch, ForwardMode, ReqToTokenPool

logger = logging.getLogger(__name__)


@dataclass
class GenerateOutput:
    tokens: list[list[int]]              # the tokens appended to each request (sampled or forced)
    logits: torch.Tensor | None = None   # fp32 [batch, steps, vocab]; step 0 follows the prompt


class Engine:
    def __init__(self, model, max_total_tokens: int | None = None, swa_tokens: int | None = None,
                 page_size: int = 256, max_batch: int = 8, max_context_len: int | None = None):
        cfg = model.config
        self.model = model
        self.device = next(model.parameters()).device
        self.max_context_len = max_context_len or model.max_seq_len
        if self.max_context_len > model.max_seq_len:
            raise ValueError(f"max_context_len={self.max_context_len} exceeds the model's RoPE "
                             f"tables (max_seq_len={model.max_seq_len})")
        pages_per_req = -(-self.max_context_len // page_size)
        if max_total_tokens is None:
            max_total_tokens = max_batch * pages_per_req * page_size
        if swa_tokens is None:
            # A prefill takes SWA slots for every prompt token (pages that leave the window are
            # freed after the step), so by default the SWA side can hold all of them.
            swa_tokens = max_total_tokens
        spec = KVCacheSpec(compress_ratios=cfg.compress_ratios[:cfg.n_layers],
                           window_size=cfg.window_size)
        self.pool, self.allocator = create_dsv4_kv_cache(
            spec, max_total_tokens, swa_tokens, page_size, self.device, max_num_reqs=max_batch + 1)
        self.req_to_token_pool = ReqToTokenPool(max_batch, self.max_context_len, self.device)
        self.page_size = page_size

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_to_token_pool.req_to_token

    def forward(self, batch: ForwardBatch, all_logits: bool = False) -> torch.Tensor:
        return self.model(batch, self.pool, self.req_to_token, all_logits=all_logits)

    @torch.no_grad()
    def generate(self, prompt_token_ids: list[list[int]], max_new_tokens: int,
                 return_logits: bool = False,
                 forced_tokens: list[list[int]] | None = None) -> GenerateOutput:
        if not prompt_token_ids or any(len(p) == 0 for p in prompt_token_ids):
            raise ValueError("prompt_token_ids must hold at least one non-empty prompt")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if forced_tokens is not None and (len(forced_tokens) != len(prompt_token_ids) or any(
                len(f) < max_new_tokens for f in forced_tokens)):
            raise ValueError("forced_tokens needs one list of >= max_new_tokens tokens per prompt")
        longest = max(len(p) for p in prompt_token_ids) + max_new_tokens - 1
        if longest > self.max_context_len:
            raise ValueError(f"prompt + max_new_tokens - 1 = {longest} tokens exceed "
                             f"max_context_len={self.max_context_len}")
        slots = self._admit(len(prompt_token_ids))
        seq_lens = [len(p) for p in prompt_token_ids]
        try:
            logits = self._prefill(slots, prompt_token_ids)
            out_tokens: list[list[int]] = [[] for _ in slots]
            steps = []
            for step in range(max_new_tokens):
                if return_logits:
                    steps.append(logits.float().cpu())
                if forced_tokens is None:
                    nxt = logits.argmax(-1).tolist()
                else:
                    nxt = [f[step] for f in forced_tokens]
                for toks, t in zip(out_tokens, nxt):
                    toks.append(int(t))
                if step + 1 < max_new_tokens:
                    seq_lens = [s + 1 for s in seq_lens]
                    logits = self._decode(slots, seq_lens, nxt)
        finally:
            self._release(slots, seq_lens)
        return GenerateOutput(out_tokens, torch.stack(steps, 1) if return_logits else None)

    # ---- steps --------------------------------------------------------------------------------

    def _admit(self, n: int) -> list[int]:
        if n > self.req_to_token_pool.available():
            raise RuntimeError(f"{n} prompts but only {self.req_to_token_pool.available()} free "
                               "request slots (raise max_batch)")
        slots = [self.req_to_token_pool.alloc() for _ in range(n)]
        self.pool.clear_compressor_state(torch.tensor(slots, device=self.device))
        return slots

    def _prefill(self, slots, prompts) -> torch.Tensor:
        lens = torch.tensor([len(p) for p in prompts])
        locs = self.allocator.alloc_extend(torch.zeros_like(lens), lens, torch.full_like(lens, -1),
                                           int(lens.sum()))
        if locs is None:
            raise RuntimeError(f"KV pool exhausted: prefill of {int(lens.sum())} tokens")
        start = 0
        for slot, n in zip(slots, lens.tolist()):
            self.req_to_token_pool.write(slot, 0, locs[start:start + n])
            start += n
        dev = self.device
        batch = ForwardBatch(
            ForwardMode.EXTEND,
            input_ids=torch.tensor([t for p in prompts for t in p], device=dev),
            positions=torch.cat([torch.arange(n) for n in lens.tolist()]).to(dev),
            out_cache_loc=locs, req_pool_indices=torch.tensor(slots, device=dev),
            seq_lens=lens.to(dev), extend_seq_lens=lens.to(dev))
        logits = self.forward(batch)
        self._evict_out_of_window(slots, lens.tolist())
        return logits

    def _decode(self, slots, seq_lens, tokens) -> torch.Tensor:
        dev = self.device
        rows = torch.tensor(slots, device=dev)
        lens = torch.tensor(seq_lens, device=dev)
        last_loc = self.req_to_token[rows, lens - 2].long().cpu()
        locs = self.allocator.alloc_decode(lens.cpu(), last_loc)
        if locs is None:
            raise RuntimeError("KV pool exhausted during decode")
        for slot, n, loc in zip(slots, seq_lens, locs):
            self.req_to_token_pool.write(slot, n - 1, loc.view(1))
        batch = ForwardBatch(ForwardMode.DECODE, input_ids=torch.tensor(tokens, device=dev),
                             positions=lens - 1, out_cache_loc=locs, req_pool_indices=rows,
                             seq_lens=lens)
        logits = self.forward(batch)
        self._evict_out_of_window(slots, seq_lens)
        return logits

    def _evict_out_of_window(self, slots, seq_lens) -> None:
        window = self.model.config.window_size
        for slot, n in zip(slots, seq_lens):
            self.allocator.free_swa_out_of_window(self.req_to_token[slot, :n].cpu(), n, window)

    def _release(self, slots, seq_lens) -> None:
        for slot, n in zip(slots, seq_lens):
            self.allocator.free(self.req_to_token[slot, :n].long().cpu())
            self.req_to_token_pool.free(slot)
