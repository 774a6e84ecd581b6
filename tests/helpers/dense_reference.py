"""A dense, plain restatement of DeepSeek-V4 (docs/decode_path.md, section 1) for one request.

No pools, no kernels, no modules: plain tensors read from a state dict with the reference tensor
names. The whole sequence 0..T-1 is computed layer by layer, and each position sees exactly what a
decode step at that position would see:

- its sliding window: the last min(t + 1, window) tokens, itself included;
- compressed rows c < (t + 1) // ratio (a token on a boundary sees its own window's row, as the
  decode order "write window KV, run the compressor, then attend" implies); ratio 4 layers keep the
  indexer's top-k of those, ratio 128 layers all of them;
- the per-head sink in the softmax denominator.

KV rows (window and compressed) go through the cache's FP8 simulation (nope dims quantized per
64-wide tile with power-of-two scales, RoPE dims kept in bf16), done with the kernel layer's
quantize/dequantize helpers. Everything else (RoPE/YaRN, mHC/Sinkhorn, compressor pooling, FP4 and
Hadamard of the indexer, MoE) is written out here independently of the ``dsv4`` package.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from hip_kernels import kv_layout
from hip_kernels.options import DEFAULT_KERNEL_OPTIONS

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ---- elementary pieces ---------------------------------------------------------------------------

def rmsnorm(x, weight, eps):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.float() * y
    return y.to(x.dtype)


def linear(x, w):
    return F.linear(x, w)


def rope_inv_freq(cfg, ratio):
    """Per-pair frequencies: rope_theta for ratio-0 layers; compress_rope_theta + YaRN otherwise."""
    dim = cfg.rope_head_dim
    base = cfg.compress_rope_theta if ratio else cfg.rope_theta
    inv = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if ratio and cfg.original_seq_len > 0:
        def corr_dim(rotations):
            turns = cfg.original_seq_len / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(base))
        low = max(math.floor(corr_dim(cfg.beta_fast)), 0)
        high = min(math.ceil(corr_dim(cfg.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        smooth = 1 - ramp
        inv = inv / cfg.rope_factor * (1 - smooth) + inv * smooth
    return inv


def rope_last(x, pos, inv, inverse=False):
    """Interleaved rotation of the last 64 dims of x [T, (H,) D] at positions pos [T]."""
    ang = torch.outer(pos.float(), inv)
    c, s = torch.cos(ang), torch.sin(ang)
    if inverse:
        s = -s
    if x.dim() == 3:
        c, s = c[:, None], s[:, None]
    r = x[..., -64:].float()
    a, b = r[..., 0::2], r[..., 1::2]
    rot = torch.stack([a * c - b * s, a * s + b * c], -1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-64], rot], -1)


def fp8_kv_sim(rows):
    """What the cache returns for rows [N, 512]: quantize + dequantize (bf16-exact), in the FP8
    dialect of the default KernelOptions (the model's, unless a test gives it others)."""
    nope, rope, scales = kv_layout.quantize_kv_rows(rows, DEFAULT_KERNEL_OPTIONS.fp8_dialect)
    return kv_layout.dequantize_kv_rows(nope, rope, scales).to(torch.bfloat16)


def fp4_sim(x):
    """e2m1 per 32-block, scale 2^ceil(log2(amax / 6)), nearest with ties to the even grid index."""
    z = x.float().reshape(-1, 32)
    amax = z.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0 ** -126)
    m, e = torch.frexp(amax / 6)                       # amax/6 = m * 2^e, m in [0.5, 1)
    scale = torch.ldexp(torch.ones_like(amax), torch.where(m == 0.5, e - 1, e))
    y = (z / scale).clamp(-6, 6)
    dist = (y.abs().unsqueeze(-1) - E2M1_GRID).abs()
    idx = dist.argmin(-1)
    nxt = (idx + 1).clamp(max=7)
    tie = (dist.gather(-1, nxt.unsqueeze(-1)) == dist.gather(-1, idx.unsqueeze(-1))).squeeze(-1)
    idx = torch.where(tie & (nxt != idx) & (idx % 2 == 1), nxt, idx)
    q = torch.copysign(E2M1_GRID[idx], y)
    return (q * scale).reshape(x.shape).to(x.dtype)


def hadamard(x):
    d = x.shape[-1]
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]]), h)
    return ((x.float() @ h) * d ** -0.5).to(x.dtype)


# ---- mHC -----------------------------------------------------------------------------------------

def hc_weights(x, fn, scale, base, cfg):
    hc = cfg.hc_mult
    xf = x.flatten(1).float()
    mixes = (xf @ fn.T) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + cfg.hc_eps
    post = 2 * torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(-1, hc, hc)
    comb = comb.softmax(-1) + cfg.hc_eps
    comb = comb / (comb.sum(1, keepdim=True) + cfg.hc_eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(2, keepdim=True) + cfg.hc_eps)
        comb = comb / (comb.sum(1, keepdim=True) + cfg.hc_eps)
    return pre, post, comb


def hc_combine(x, pre):
    return (pre.unsqueeze(-1) * x.float()).sum(1).to(x.dtype)


def hc_expand(out, x, post, comb):
    # X'_j = post_j * out + sum_i comb[i, j] X_i
    mixed = torch.einsum("tij,tid->tjd", comb, x.float())
    return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed).to(out.dtype)


# ---- attention -----------------------------------------------------------------------------------

def compress(x, w, prefix, ratio, head_dim, inv, rotate, eps):
    """Compressed rows [T // ratio, head_dim] of x [T, dim] (windows that are complete)."""
    T = x.shape[0]
    d = head_dim
    pos = torch.arange(T)
    kv = x.float() @ w[prefix + "wkv.weight"].float().T
    sc = x.float() @ w[prefix + "wgate.weight"].float().T + w[prefix + "ape"][pos % ratio]
    pooled = []
    for win in range(T // ratio):
        cur = slice(win * ratio, (win + 1) * ratio)
        if ratio == 4:
            k, s = kv[cur, d:], sc[cur, d:]
            if win > 0:
                prev = slice((win - 1) * ratio, win * ratio)
                k = torch.cat([kv[prev, :d], k])
                s = torch.cat([sc[prev, :d], s])
        else:
            k, s = kv[cur], sc[cur]
        pooled.append((k * s.softmax(0)).sum(0))
    if not pooled:
        return torch.zeros(0, d, dtype=torch.bfloat16)
    rows = rmsnorm(torch.stack(pooled).to(torch.bfloat16), w[prefix + "norm.weight"], eps)
    rows = rope_last(rows, torch.arange(len(pooled)) * ratio, inv)
    if rotate:
        rows = fp4_sim(hadamard(rows))
    return rows


def indexer_scores(cfg, w, p, y, qr, inv):
    """fp32 [T, T // 4]: score[t, c] = sum_h relu(q_h(t) . k_c) * w_h(t) on a ratio-4 layer."""
    T = y.shape[0]
    pos = torch.arange(T)
    H, D = cfg.index_n_heads, cfg.index_head_dim
    q = linear(qr, w[p + "indexer.wq_b.weight"]).view(T, H, D)
    q = fp4_sim(hadamard(rope_last(q, pos, inv)))
    keys = compress(y, w, p + "indexer.compressor.", 4, D, inv, True, cfg.norm_eps)
    hw = linear(y, w[p + "indexer.weights_proj.weight"]).float() * (D ** -0.5 * H ** -0.5)
    return (torch.einsum("thd,cd->thc", q.float(), keys.float()).relu() * hw.unsqueeze(-1)).sum(1)


def top_k_selection(cfg, score):
    """Boolean [T, C]: the top index_topk of the rows c < (t + 1) // 4 (all when fewer)."""
    T, C = score.shape
    sel = torch.zeros(T, C, dtype=torch.bool)
    for t in range(T):
        n_vis = (t + 1) // 4
        if n_vis <= cfg.index_topk:
            sel[t, :n_vis] = True
        else:
            sel[t, score[t, :n_vis].topk(cfg.index_topk).indices] = True
    return sel


def attention(cfg, w, i, y, selection=None, trace=None):
    p = f"layers.{i}.attn."
    ratio = cfg.compress_ratios[i]
    T = y.shape[0]
    H, hd = cfg.n_heads, cfg.head_dim
    pos = torch.arange(T)
    inv = rope_inv_freq(cfg, ratio)

    qr = rmsnorm(linear(y, w[p + "wq_a.weight"]), w[p + "q_norm.weight"], cfg.norm_eps)
    q = rmsnorm(linear(qr, w[p + "wq_b.weight"]).view(T, H, hd), None, cfg.norm_eps)
    q = rope_last(q, pos, inv)

    kv = rmsnorm(linear(y, w[p + "wkv.weight"]), w[p + "kv_norm.weight"], cfg.norm_eps)
    rows = [fp8_kv_sim(rope_last(kv, pos, inv))]
    j = torch.arange(T)
    visible = [(j[None] <= pos[:, None]) & (j[None] > pos[:, None] - cfg.window_size)]
    if ratio:
        comp = compress(y, w, p + "compressor.", ratio, hd, inv, False, cfg.norm_eps)
        n = comp.shape[0]
        rows.append(fp8_kv_sim(comp) if n else comp)
        seen = torch.arange(n)[None] < ((pos + 1) // ratio)[:, None]
        if ratio == 4:
            score = indexer_scores(cfg, w, p, y, qr, inv)
            if trace is not None:
                trace["index", i] = score
            chosen = top_k_selection(cfg, score) if selection is None else selection[i]
            seen &= chosen
        visible.append(seen)
    K = torch.cat(rows).float()
    vis = torch.cat(visible, 1)

    s = torch.einsum("thd,kd->thk", q.float(), K) * hd ** -0.5
    s = s.masked_fill(~vis[:, None], float("-inf"))
    sink = w[p + "attn_sink"].float()[None, :, None].expand(T, H, 1)
    prob = torch.cat([s, sink], -1).softmax(-1)[..., :-1]
    o = torch.einsum("thk,kd->thd", prob, K).to(y.dtype)
    o = rope_last(o, pos, inv, inverse=True)

    G, R = cfg.o_groups, cfg.o_lora_rank
    og = o.reshape(T, G, H * hd // G)
    t = torch.einsum("tgd,grd->tgr", og, w[p + "wo_a.weight"].view(G, R, -1))
    return linear(t.flatten(1), w[p + "wo_b.weight"])


# ---- MoE -----------------------------------------------------------------------------------------

def expert(w, p, x, weight, limit):
    gate = linear(x, w[p + "w1.weight"]).float()
    up = linear(x, w[p + "w3.weight"]).float()
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    h = F.silu(gate) * up
    if weight is not None:
        h = weight.unsqueeze(-1) * h
    return linear(h.to(x.dtype), w[p + "w2.weight"])


def moe(cfg, w, i, x, tokens, routing=None, trace=None):
    p = f"layers.{i}.ffn."
    s = linear(x.float(), w[p + "gate.weight"].float())
    s = F.softplus(s).sqrt()
    if i < cfg.n_hash_layers:
        idx = w[p + "gate.tid2eid"][tokens].long()
    else:
        biased = s + w[p + "gate.bias"]
        if trace is not None:
            trace["route", i] = biased
        idx = biased.topk(cfg.n_activated_experts, -1).indices if routing is None else routing[i]
    weights = s.gather(1, idx)
    weights = weights / weights.sum(-1, keepdim=True) * cfg.route_scale
    y = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(cfg.n_routed_experts):
        we = (weights * (idx == e)).sum(-1)           # 0 where e was not chosen
        y += expert(w, f"{p}experts.{e}.", x, we, cfg.swiglu_limit)
    if cfg.n_shared_experts:
        y += expert(w, p + "shared_experts.", x, None, cfg.swiglu_limit)
    return y.to(x.dtype)


# ---- the model -----------------------------------------------------------------------------------

@torch.no_grad()
def dense_logits(cfg, state_dict, tokens, selection=None, routing=None, trace=None) -> torch.Tensor:
    """fp32 logits [T, vocab] of one request's tokens: row t predicts token t + 1.

    The two discrete choices can be imposed, to compare an implementation whose near-tied choices
    went the other way: ``selection`` (layer -> bool [T, T // 4]) replaces the indexer's top-k on
    ratio-4 layers, ``routing`` (layer -> int [T, k]) the experts of score-routed MoE layers.
    ``trace`` (a dict) receives ("index", layer) -> indexer scores [T, T // 4] and
    ("route", layer) -> biased gate scores [T, n_routed_experts]."""
    w = {k: v.detach().cpu() for k, v in state_dict.items()}
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    x = F.embedding(tokens, w["embed.weight"]).unsqueeze(1).repeat(1, cfg.hc_mult, 1)
    for i in range(cfg.n_layers):
        p = f"layers.{i}."
        pre, post, comb = hc_weights(x, w[p + "hc_attn_fn"], w[p + "hc_attn_scale"],
                                     w[p + "hc_attn_base"], cfg)
        y = rmsnorm(hc_combine(x, pre), w[p + "attn_norm.weight"], cfg.norm_eps)
        x = hc_expand(attention(cfg, w, i, y, selection, trace), x, post, comb)
        pre, post, comb = hc_weights(x, w[p + "hc_ffn_fn"], w[p + "hc_ffn_scale"],
                                     w[p + "hc_ffn_base"], cfg)
        y = rmsnorm(hc_combine(x, pre), w[p + "ffn_norm.weight"], cfg.norm_eps)
        x = hc_expand(moe(cfg, w, i, y, tokens, routing, trace), x, post, comb)
    xf = x.flatten(1).float()
    mixes = (xf @ w["hc_head_fn"].T) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + cfg.norm_eps)
    pre = torch.sigmoid(mixes * w["hc_head_scale"] + w["hc_head_base"]) + cfg.hc_eps
    y = rmsnorm(hc_combine(x, pre), w["norm.weight"], cfg.norm_eps)
    return F.linear(y.float(), w["head.weight"].float())
