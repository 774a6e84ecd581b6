"""Compare this repo's eager decode with the reference inference code.

Runs both on the same checkpoint and token ids, teacher-forced (the first token as the prompt,
then one forced token per decode step), and reports per-position logits agreement: mean / worst
cosine, positions whose argmax differs, bit-identical positions. Then, with intermediate tensors
recorded at every step and layer by hooks on both models, names the FIRST tensor that differs
(bitwise) at each step whose logits are not bit-identical.

    python scripts/reference_oracle/compare.py --reference-dir PATH/TO/inference \\
        --checkpoint CKPT_DIR --tokens random:300:0 [--ref-logits ref_logits.safetensors] \\
        [--mode fp8]

--mode fp8 runs the reference in its FP8 mode (run_reference.py: a quantized checkpoint, FP8/FP4
linears through act_quant + fp8_gemm / fp4_gemm); this repo loads the same checkpoint with
``load_model`` either way.

The reference runs in this process (run_reference.build) so its intermediates can be recorded;
--ref-logits, if given, is checked against that in-process run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import run_reference as refdrv  # noqa: E402

# Recorded tensor names, in the order the layer computes them.
ORDER = ["hc_attn.y", "hc_attn.post", "hc_attn.comb", "attn_norm", "qr", "q", "idx.q", "idx.w",
         "idx.keys", "idx.scores", "idx.topk_set", "idx.topk", "win.rows", "cmp.rows",
         "attn.o", "attn.out", "hc_attn.out", "hc_ffn.y", "hc_ffn.post", "hc_ffn.comb",
         "ffn_norm", "gate.idx", "gate.w", "ffn.out", "layer.out"]


class Recorder:
    def __init__(self):
        self.step = 0
        self.layer = None
        self.data: dict[tuple[int, int, str], torch.Tensor] = {}
        self.hc_calls = defaultdict(int)

    def put(self, name: str, t, layer=None):
        layer = self.layer if layer is None else layer
        self.data[(self.step, layer, name)] = (t.detach().clone() if torch.is_tensor(t) else t)


# ---- the reference ------------------------------------------------------------------------------

def instrument_reference(ref, model, rec: Recorder):
    win = model.layers[0].attn.window_size
    for lid, blk in enumerate(model.layers):
        blk.register_forward_pre_hook(lambda m, a, lid=lid: setattr(rec, "layer", lid))
        blk.register_forward_hook(lambda m, a, o: rec.put("layer.out", o[0, 0]))
        blk.attn_norm.register_forward_hook(lambda m, a, o: rec.put("attn_norm", o[0, 0]))
        blk.ffn_norm.register_forward_hook(lambda m, a, o: rec.put("ffn_norm", o[0, 0]))
        blk.attn.q_norm.register_forward_hook(lambda m, a, o: rec.put("qr", o[0, 0]))
        blk.attn.register_forward_hook(lambda m, a, o: rec.put("attn.out", o[0, 0]))
        blk.ffn.register_forward_hook(lambda m, a, o: rec.put("ffn.out", o[0, 0]))

        def gate_hook(m, a, o):
            w, idx = o
            order = idx[0].argsort()
            rec.put("gate.idx", idx[0][order])
            rec.put("gate.w", w[0][order])
        blk.ffn.gate.register_forward_hook(gate_hook)
        if getattr(blk.attn, "indexer", None) is not None:
            blk.attn.indexer.register_forward_hook(
                lambda m, a, o, blk=blk: _ref_indexer_record(rec, m, a, o))

    hc_pre, hc_post = ref.Block.hc_pre, ref.Block.hc_post

    def hc_pre_w(self, x, fn, scale, base):
        y, post, comb = hc_pre(self, x, fn, scale, base)
        part = "hc_attn" if fn is self.hc_attn_fn else "hc_ffn"
        rec.put(f"{part}.y", y[0, 0]); rec.put(f"{part}.post", post[0, 0])
        rec.put(f"{part}.comb", comb[0, 0])
        return y, post, comb

    def hc_post_w(self, x, residual, post, comb):
        out = hc_post(self, x, residual, post, comb)
        if (rec.step, rec.layer, "hc_attn.out") not in rec.data:
            rec.put("hc_attn.out", out[0, 0])
        return out
    ref.Block.hc_pre, ref.Block.hc_post = hc_pre_w, hc_post_w

    sparse = ref.sparse_attn

    def sparse_w(q, kv, sink, topk_idxs, scale):
        o = sparse(q, kv, sink, topk_idxs, scale)
        rec.put("q", q[0, 0])
        idx = topk_idxs[0, 0].long()
        w_idx, c_idx = idx[:win], idx[win:]
        rec.put("win.rows", kv[0, w_idx[w_idx >= 0]])
        rec.put("cmp.rows", kv[0, c_idx[c_idx >= 0]])
        rec.put("attn.o", o[0, 0])
        return o
    ref.sparse_attn = sparse_w

    fp4 = ref.fp4_act_quant

    def fp4_w(x, block, inplace=False):
        out = fp4(x, block, inplace)
        if x.dim() == 4 and x.size(2) == model.layers[rec.layer].attn.indexer.n_local_heads:
            rec.put("idx.q", x[0, 0])                          # the indexer's query
        return out
    ref.fp4_act_quant = fp4_w


def _ref_indexer_record(rec, m, args, topk):
    """Index scores recomputed with the reference's own expression (bf16 einsum, relu, weights,
    head sum) from its recorded q and key cache; top-k as returned (offset removed)."""
    x, qr, start_pos, offset = args
    q = rec.data[(rec.step, rec.layer, "idx.q")].unsqueeze(0).unsqueeze(0)
    end = start_pos + 1
    keys = m.kv_cache[:1, :end // m.compress_ratio]
    weights = m.weights_proj(x) * (m.softmax_scale * m.n_heads ** -0.5)
    score = torch.einsum("bshd,btd->bsht", q, keys)
    score = (score.relu_() * weights.unsqueeze(-1)).sum(dim=2)
    rec.put("idx.w", weights[0, 0])
    rec.put("idx.keys", keys[0])
    rec.put("idx.scores", score[0, 0])
    t = topk[0, 0].long() - offset
    rec.put("idx.topk", t)
    rec.put("idx.topk_set", t.sort().values)


def run_ref(args, tokens, max_seq_len):
    ref, model, _ = refdrv.build(args.reference_dir, args.checkpoint, max_seq_len,
                                 args.hadamard, args.sparse_attn, args.mode)
    rec = Recorder()
    instrument_reference(ref, model, rec)

    def step(i):
        rec.step = i + 1
    logits = refdrv.teacher_forced_logits(model, [tokens], on_step=step)[0]
    return logits, rec


# ---- this repo ----------------------------------------------------------------------------------

def instrument_ours(model, rec: Recorder):
    import dsv4.paged_attention as dm
    from dsv4.layers import mhc
    from dsv4.layers.attention import Attention
    from dsv4.layers.indexer import Indexer

    for lid, layer in enumerate(model.layers):
        layer.register_forward_pre_hook(lambda m, a, lid=lid: setattr(rec, "layer", lid))
        layer.register_forward_hook(lambda m, a, o: rec.put("layer.out", o[0]))
        layer.attn.q_norm.register_forward_hook(lambda m, a, o: rec.put("qr", o[0]))
        layer.ffn.register_forward_hook(lambda m, a, o: rec.put("ffn.out", o[0]))

        def gate_hook(m, a, o):
            w, idx = o
            order = idx[0].argsort()
            rec.put("gate.idx", idx[0][order])
            rec.put("gate.w", w[0][order])
        layer.ffn.gate.register_forward_hook(gate_hook)
    model.register_forward_hook(lambda m, a, o: setattr(rec, "step", rec.step + 1))

    hc_pre, hc_post, attend = mhc.hc_pre, mhc.hc_post, dm.attend

    def hc_pre_w(x, fn, scale, base, *rest, norm=None, **kw):
        # The layer fuses attn_norm / ffn_norm into mHC pre (bit-equal to the two steps): run
        # them apart here to record the block input before and after its norm.
        y, post, comb = hc_pre(x, fn, scale, base, *rest, **kw)
        layer = model.layers[rec.layer]
        part = "hc_attn" if fn is layer.hc_attn_fn else "hc_ffn"
        rec.put(f"{part}.y", y[0]); rec.put(f"{part}.post", post[0])
        rec.put(f"{part}.comb", comb[0])
        if norm is not None:
            y = norm(y)
            rec.put("attn_norm" if part == "hc_attn" else "ffn_norm", y[0])
        return y, post, comb

    def hc_post_w(out, residual, post, comb, *rest):
        r = hc_post(out, residual, post, comb, *rest)
        if (rec.step, rec.layer, "hc_attn.out") not in rec.data:
            rec.put("hc_attn.out", r[0])
        return r

    def attend_w(attn, q, *a, **k):
        out = attend(attn, q, *a, **k)
        rec.put("attn.out", out[0])
        return out
    mhc.hc_pre, mhc.hc_post, dm.attend = hc_pre_w, hc_post_w, attend_w

    sparse = Attention.sparse_attention

    def sparse_w(self, q, kv, valid, *rest, **kw):
        o = sparse(self, q, kv, valid, *rest, **kw)
        rec.put("q", q[0])
        rec.put("win.rows", kv[0][0][valid[0][0]])
        if len(kv) > 1:
            rec.put("cmp.rows", kv[1][0][valid[1][0]])
        else:
            rec.put("cmp.rows", kv[0][0][:0])
        rec.put("attn.o", o[0])
        return o
    Attention.sparse_attention = sparse_w

    decode_op = dm.sparse_decode_attention

    def decode_w(q, swa, wloc, wok, swa_page, cmp, cloc, cok, cmp_page, *rest, **kw):
        """Decode attention reads the caches in place: record the rows it reads."""
        o = decode_op(q, swa, wloc, wok, swa_page, cmp, cloc, cok, cmp_page, *rest, **kw)
        from hip_kernels import DEFAULT_KERNEL_OPTIONS, kv_layout
        dialect = kw.get("kernel", DEFAULT_KERNEL_OPTIONS).fp8_dialect
        rec.put("q", q[0])
        rec.put("win.rows", kv_layout.read_kv_rows(swa, wloc[0][wok[0]], swa_page, dialect))
        if cmp is not None:
            rec.put("cmp.rows", kv_layout.read_kv_rows(cmp, cloc[0][cok[0]], cmp_page, dialect))
        else:
            rec.put("cmp.rows", q.new_zeros(0, q.shape[-1], dtype=torch.float32))
        rec.put("attn.o", o[0])
        return o
    dm.sparse_decode_attention = decode_w

    project_q, head_weights, select = Indexer.project_q, Indexer.head_weights, Indexer.select
    scores = dm.indexer_scores

    def project_q_w(self, qr, freqs, *rest, **kw):
        q = project_q(self, qr, freqs, *rest, **kw)
        rec.put("idx.q", q[0])
        return q

    def head_weights_w(self, x, *rest, **kw):
        w = head_weights(self, x, *rest, **kw)
        rec.put("idx.w", w[0] * self.weight_scale)   # as the reference has them: scaled
        return w

    def scores_w(q, w, cache, loc, visible, page_size, **kw):
        """The scores op reads the key cache in place: record the keys it reads."""
        from hip_kernels import DEFAULT_KERNEL_OPTIONS, kv_layout
        s = scores(q, w, cache, loc, visible, page_size, **kw)
        dialect = kw.get("kernel", DEFAULT_KERNEL_OPTIONS).fp8_dialect
        rec.put("idx.scores_all", s[0])
        rec.put("idx.keys_all", kv_layout.read_indexer_rows(cache, loc[0], page_size, dialect))
        return s

    def select_w(self, s, visible, *rest, **kw):
        pick = select(self, s, visible, *rest, **kw)
        v = visible[0]
        rec.put("idx.scores", rec.data[(rec.step, rec.layer, "idx.scores_all")][v])
        rec.put("idx.keys", rec.data[(rec.step, rec.layer, "idx.keys_all")][v])
        p = pick[0][pick[0] >= 0]
        # pick indexes the plan's row order: map to compressed row numbers (visible rows are
        # the request's compressed rows 0.. in order)
        rank = torch.cumsum(v.long(), 0) - 1
        t = rank[p]
        rec.put("idx.topk", t)
        rec.put("idx.topk_set", t.sort().values)
        return pick
    Indexer.project_q, Indexer.head_weights = project_q_w, head_weights_w
    dm.indexer_scores, Indexer.select = scores_w, select_w


def run_ours(args, tokens):
    from dsv4.checkpoint import load_model
    from dsv4.engine import Engine

    model = load_model(args.checkpoint)
    rec = Recorder()
    instrument_ours(model, rec)
    L = len(tokens)
    ctx = max(512, -(-(L + 1) // 128) * 128)
    engine = Engine(model, max_batch=1, max_context_len=ctx, page_size=128, graph=False)
    forced = [tokens[1:] + [tokens[0]]]
    out = engine.generate([tokens[:1]], L, return_logits=True, forced_tokens=forced)
    return out.logits[0], rec


# ---- comparison ---------------------------------------------------------------------------------

def same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.numel() != b.numel():
        return False
    a, b = a.reshape(-1), b.reshape(-1)
    if a.is_floating_point() or b.is_floating_point():
        return torch.equal(a.float(), b.float())
    return torch.equal(a.long(), b.long())


def diff_note(a, b) -> str:
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.numel() != b.numel():
        return f"shape ours {tuple(a.shape)} vs ref {tuple(b.shape)}"
    if not a.is_floating_point() and not b.is_floating_point():
        return f"ours {a.tolist()} vs ref {b.tolist()}"
    d = (a.float().reshape(-1) - b.float().reshape(-1)).abs()
    n = int((d > 0).sum())
    return f"{n}/{d.numel()} elements differ, max |diff| {d.max().item():.3g}"


def first_difference(ours: Recorder, ref: Recorder, step: int, n_layers: int):
    for layer in range(n_layers):
        for name in ORDER:
            key = (step, layer, name)
            if key not in ours.data and key not in ref.data:
                continue
            a, b = ours.data.get(key), ref.data.get(key)
            if a is None or b is None:
                return layer, name, f"recorded only by {'ours' if b is None else 'the reference'}"
            if not same(a, b):
                return layer, name, diff_note(a, b)
    return None


def logits_report(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    cos = torch.nn.functional.cosine_similarity(ours.double(), ref.double(), dim=-1)
    arg = ours.argmax(-1) != ref.argmax(-1)
    ident = (ours == ref).all(-1)
    return {"positions": int(ours.shape[0]), "mean_cos": float(cos.mean()),
            "worst_cos": float(cos.min()), "worst_pos": int(cos.argmin()),
            "argmax_mismatch": int(arg.sum()), "argmax_mismatch_frac": float(arg.float().mean()),
            "bit_identical": int(ident.sum()),
            "first_non_identical": int((~ident).nonzero()[0]) if (~ident).any() else None,
            "max_abs_diff": float((ours - ref).abs().max())}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference-dir", required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--tokens", default="random:300:0")
    ap.add_argument("--ref-logits", default=None)
    ap.add_argument("--mode", choices=sorted(refdrv.MODES), default="bf16",
                    help="the reference's dtype (run_reference.py --mode)")
    ap.add_argument("--hadamard", choices=("cuda", "ref"), default="cuda")
    ap.add_argument("--sparse-attn", choices=("tilelang", "onepass"), default="tilelang")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--show", type=int, default=12, help="differing steps to list")
    ap.add_argument("--json", default=None, help="write the report here too")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    cfg = json.loads((Path(a.checkpoint) / "config.json").read_text())
    tokens = refdrv.parse_tokens(a.tokens, cfg["vocab_size"])
    max_seq_len = max(512, -(-len(tokens) // 128) * 128)

    ref_logits, ref_rec = run_ref(a, tokens, max_seq_len)
    if a.ref_logits:
        from safetensors.torch import load_file
        saved = load_file(a.ref_logits)
        assert saved["tokens"].tolist() == tokens, "--ref-logits was made for other tokens"
        print("saved reference logits identical to this run:",
              torch.equal(saved["logits"], ref_logits))
    torch.set_default_dtype(torch.float32)
    our_logits, our_rec = run_ours(a, tokens)

    rep = logits_report(our_logits, ref_logits)
    print(json.dumps(rep, indent=1))
    n_layers = cfg["n_layers"]
    ident = (our_logits == ref_logits).all(-1)
    firsts = {}
    shown = 0
    for step in range(len(tokens)):
        if ident[step]:
            continue
        fd = first_difference(our_rec, ref_rec, step, n_layers)
        firsts[step] = fd
        if shown < a.show:
            print(f"step {step}: first difference: "
                  + ("none recorded" if fd is None else f"layer {fd[0]} {fd[1]}: {fd[2]}"))
            shown += 1
    tally = defaultdict(int)
    for fd in firsts.values():
        tally["none" if fd is None else f"layer {fd[0]} {fd[1]}"] += 1
    print("first differing tensor, counted over the non-identical steps:")
    for k, v in sorted(tally.items(), key=lambda kv: -kv[1]):
        print(f"  {v:4d}  {k}")
    if a.json:
        rep["first_difference"] = {str(s): (None if f is None else list(f))
                                   for s, f in firsts.items()}
        Path(a.json).write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
