"""Run in a fresh process (it initialises a gloo process group): SGLang 0.5.23's real
DeepseekV4ForCausalLM for a small config, loaded by SGLang's own `load_weights` from a checkpoint
in the published names and formats, its FP8 dense layers then made fnuz by SGLang's own
`normalize_e4m3fn_to_e4m3fnuz` exactly as its `Fp8LinearMethod.process_weights_after_loading`
does on ROCm gfx942 (on a CPU that method takes its AMX path instead, so it is not called). Then
the spec's load hook and build run over it, and the result (its tensors, and its logits over
this project's pool for an extend and two decode steps) is checked against this project's
checkpoint loader's model.

Stand-ins, each for something that needs a GPU: SGLang's CPU rope factory asserts YaRN scaling,
so the sliding-window-only layer's plain RoPE comes from SGLang's `get_rope`; the mHC kernels'
prewarm at the end of `load_weights` (it queries the GPU's compute units) does nothing.

argv: checkpoint dir. Prints one line of JSON with the measurements; the test asserts them.
"""

import json
import sys
from pathlib import Path

import torch

from sglang_host import install_cpu_context, use_stubs

use_stubs()
install_cpu_context()

from dsv4.checkpoint import load_model  # noqa: E402
from dsv4.config import ModelConfig  # noqa: E402
from dsv4.options import Options  # noqa: E402
from dsv4.plugins import sglang_mono_inplace as inplace  # noqa: E402
from dsv4.plugins import sglang_mono_weights as weights  # noqa: E402
from dsv4.weights.loader import checkpoint_files  # noqa: E402
from dsv4.weights.saver import config_dict  # noqa: E402
from sglang_mono_sides import our_side, run  # noqa: E402


def sglang_config(config: ModelConfig):
    from sglang.srt.configs.deepseek_v4 import DeepSeekV4Config

    d = config_dict(config, "hf", True)
    d.pop("model_type")
    d.update(n_hash_layers=d["num_hash_layers"], n_group=1,
             topk_group=1, max_position_embeddings=config.original_seq_len,
             kv_source_layer_ids=[], index_source_layer_ids=[], engram_layer_ids=[],
             engram_num_embeddings=[])
    return DeepSeekV4Config(**d)


def sglang_model(config: ModelConfig):
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.quantization.fp8 import Fp8Config
    from sglang.srt.layers.rotary_embedding import get_rope
    from sglang.srt.models import deepseek_v4
    from sglang.srt.runtime_context import get_parallel

    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method="tcp://127.0.0.1:29561")
    ps.initialize_model_parallel(backend="gloo")
    get_parallel().override_permanently(tp_rank=0, pp_rank=0, attn_tp_rank=0, moe_ep_rank=0,
                                        moe_tp_rank=0)
    wrapper = deepseek_v4.get_rope_wrapper

    def rope(*args, **kwargs):      # stand-in: SGLang's CPU factory asserts YaRN scaling
        if kwargs.get("rope_scaling") is None:
            kwargs.pop("device", None)
            return get_rope(*args, **kwargs)
        return wrapper(*args, **kwargs)

    deepseek_v4.get_rope_wrapper = rope
    torch.set_default_dtype(torch.bfloat16)
    quant = Fp8Config(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128],
                      is_fp4_experts=True, scale_fmt="ue8m0")
    model = deepseek_v4.DeepseekV4ForCausalLM(sglang_config(config), quant_config=quant)
    torch.set_default_dtype(torch.float32)
    model._prewarm_mhc_kernels = lambda: None   # stand-in: it queries the GPU
    return model


def checkpoint_tensors(path: Path):
    from safetensors import safe_open

    for file in checkpoint_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def make_fnuz_as_on_gfx942(model) -> int:
    """What SGLang's Fp8LinearMethod.process_weights_after_loading does on an fnuz GPU, with
    SGLang's own conversion; returns the number of layers converted."""
    from sglang.srt.layers.quantization.fp8 import Fp8LinearMethod
    from sglang.srt.layers.quantization.fp8_utils import normalize_e4m3fn_to_e4m3fnuz

    n = 0
    for module in model.modules():
        if isinstance(getattr(module, "quant_method", None), Fp8LinearMethod):
            w, s, _ = normalize_e4m3fn_to_e4m3fnuz(module.weight, module.weight_scale_inv)
            module.weight.data = w.data
            module.weight_scale_inv.data = s.data
            n += 1
    return n


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def main(path: Path) -> None:
    config = ModelConfig.from_json(path / "config.json")
    model = sglang_model(config)
    copies = {}
    tensors = []
    for name, t in checkpoint_tensors(path):
        weights.load_tensor(copies, model, name, t)
        tensors.append((name, t))
    model.load_weights(iter(tensors))
    converted = make_fnuz_as_on_gfx942(model)
    served = weights.in_place(model)

    options = Options.from_env()
    ours = weights.build_model(config, "native", copies, torch.device("cpu"),
                               config.original_seq_len, options, weights.rank_split(), model)
    theirs = dict(model.named_parameters())
    state = ours.state_dict()

    outside = []
    for name, entry in served.items():
        if entry.how != inplace.VIEW:
            continue
        t, store = state[name], theirs[entry.theirs].untyped_storage()
        lo = store.data_ptr()
        if not (lo <= t.data_ptr() and t.data_ptr() + t.nbytes <= lo + store.nbytes()):
            outside.append(name)

    reference_model = load_model(path, weights="native", options=options)
    reference = reference_model.state_dict()
    same_logits = [torch.equal(a, b) for a, b in
                   zip(run(ours, our_side(ours, 2), [5, 9], 2, options),
                       run(reference_model, our_side(reference_model, 2), [5, 9], 2, options))]
    differ = [n for n in reference
              if reference[n].dtype != state[n].dtype or reference[n].shape != state[n].shape
              or not torch.equal(as_bytes(reference[n]), as_bytes(state[n]))]
    whole = sum(t.numel() * t.element_size() for t in state.values())
    read = sum(state[n].numel() * state[n].element_size() for n, e in served.items()
               if e.how == inplace.VIEW)
    print(json.dumps({
        "converted": converted,
        "same_logits": same_logits,
        "served_kinds": sorted({e.kind for e in served.values()}),
        "views": sum(e.how == inplace.VIEW for e in served.values()),
        "outside": outside,
        "differ": differ,
        "missing": sorted(set(reference) ^ set(state)),
        "whole_bytes": whole,
        "read_bytes": read,
        "copied_bytes": weights.copied_bytes(copies),
        "kinds_in_copies": sorted({k for k, _ in copies}),
        "table_bytes": weights.in_place_bytes(config, "native", 1, fnuz=True),
    }))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
