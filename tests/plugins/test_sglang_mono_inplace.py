"""The monokernel reads SGLang's loaded parameters in place where their layout is ours.

The real check runs SGLang 0.5.23's own DeepseekV4ForCausalLM on the CPU in a fresh process
(`tests/helpers/sglang_inplace_child.py`: it initialises a gloo process group): built for the
small config, loaded by SGLang's `load_weights` from a checkpoint in the published FP8/FP4
formats, its FP8 dense layers made fnuz by SGLang's own `normalize_e4m3fn_to_e4m3fnuz` as its
`Fp8LinearMethod.process_weights_after_loading` does on ROCm gfx942 (on a CPU that method takes
its AMX path, so the child applies the ROCm conversion itself and does not call it). The spec's
`load_tensor` and build then run over that model (DSV4_FP8_DIALECT=fnuz: our FP8 is gfx942's).

Every layout read in place here is produced by SGLang's own code; none of them was written from
reading source only.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_host import stub_path_env, use_stubs

use_stubs()
pytest.importorskip("sglang.kernels.plugin_kernels.amd.spec",
                    reason="SGLang 0.5.23 is not installed (see README)")

from dsv4.checkpoint import save_random_checkpoint  # noqa: E402
from dsv4.config import ModelConfig  # noqa: E402
from dsv4.parallel import TensorSplit  # noqa: E402
from dsv4.plugins import sglang_mono_inplace as inplace  # noqa: E402

CHILD = Path(__file__).parents[1] / "helpers" / "sglang_inplace_child.py"


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    config = ModelConfig.preset("small")
    config.original_seq_len = 256
    path = save_random_checkpoint(config, tmp_path_factory.mktemp("small_ref"), seed=3)
    env = stub_path_env()
    helpers = str(CHILD.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), helpers, env.get("PYTHONPATH"))
                                        if p)
    env["DSV4_FP8_DIALECT"] = "fnuz"
    env["DSV4_KERNEL_BACKEND"] = "torch"
    proc = subprocess.run([sys.executable, str(CHILD), str(path)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_kind_read_in_place_on_gfx942(measured):
    assert measured["converted"] > 0
    assert measured["served_kinds"] == sorted(
        {"embedding", "mHC", "attn_sink", "gate", "indexer weights_proj", "compressor norm",
         "ape (ratio 128)", "fp8 dense"})


def test_in_place_parameters_are_sglangs_storage(measured):
    assert measured["views"] > 0
    assert measured["outside"] == []


def test_model_equals_the_checkpoint_loaders_byte_for_byte(measured):
    assert measured["missing"] == []
    assert measured["differ"] == []


def test_logits_equal_the_checkpoint_loaders_model_bit_for_bit(measured):
    assert measured["same_logits"] == [True, True, True]


def test_copies_drop_by_exactly_the_bytes_read_in_place(measured):
    assert measured["kinds_in_copies"] == ["dsv4-rocm model"]
    assert measured["read_bytes"] > 0
    assert measured["copied_bytes"] == measured["whole_bytes"] - measured["read_bytes"]
    # the accounting `python -m dsv4 env` prints, from the table and the config alone
    assert measured["table_bytes"] == measured["read_bytes"]


def _entry(name: str, fnuz: bool = True) -> inplace.Entry:
    return inplace.table(ModelConfig.preset("small"), TensorSplit(0, 1), fnuz)[name]


def test_a_mismatched_tensor_is_named_and_not_read_in_place():
    entry = _entry("layers.0.ffn.gate.weight")
    ours = torch.empty(8, 256, dtype=torch.bfloat16)
    assert inplace.mismatch(entry, torch.empty(8, 256, dtype=torch.bfloat16), ours) is None
    why = inplace.mismatch(entry, torch.empty(8, 256, dtype=torch.float32), ours)
    assert "model.layers.0.mlp.gate.weight" in why and "float32" in why
    why = inplace.mismatch(entry, torch.empty(8, 128, dtype=torch.bfloat16), ours)
    assert "model.layers.0.mlp.gate.weight" in why and "[8, 128]" in why
    assert "no parameter" in inplace.mismatch(entry, None, ours)


def test_wq_a_and_wkv_are_the_row_ranges_of_the_fused_wqkv_a():
    c = ModelConfig.preset("small")
    assert _entry("layers.0.attn.wq_a.weight").rows == (0, c.q_lora_rank)
    assert _entry("layers.0.attn.wkv.weight").rows == (c.q_lora_rank, c.q_lora_rank + c.head_dim)
    assert _entry("layers.0.attn.wkv.scale").rows == (c.q_lora_rank // 128,
                                                      (c.q_lora_rank + c.head_dim) // 128)


def test_no_fp8_dense_weight_is_read_in_place_on_gfx950():
    names = inplace.table(ModelConfig.preset("small"), TensorSplit(0, 1), fnuz=False)
    assert not [n for n, e in names.items() if e.kind == "fp8 dense"]


def test_replicated_tensors_give_each_rank_its_rows():
    c = ModelConfig.preset("small")
    t = inplace.table(c, TensorSplit(1, 2), fnuz=True)
    assert t["layers.0.attn.attn_sink"].rows == (c.n_heads // 2, c.n_heads)
    assert t["layers.1.attn.indexer.weights_proj.weight"].rows == (c.index_n_heads // 2,
                                                                  c.index_n_heads)
    assert t["layers.0.attn.wq_b.weight"].rows is None      # SGLang splits it as ours


def test_env_reports_bytes_read_in_place_and_held_per_isa():
    from dsv4.plugins.sglang_monokernel import coverage

    lines = [x for x in coverage() if "weights beside SGLang's" in x]
    assert [x.split(",")[0].strip() for x in lines] == [
        "flash on gfx942", "flash on gfx950", "pro on gfx942", "pro on gfx950"]
    for line in lines:
        assert line.count("read in place") == 4 and line.count("held") == 4
    # gfx942 also reads the FP8 dense weights in place: more bytes than gfx950
    tp1 = [float(x.split("TP1 ")[1].split(" ")[0]) for x in lines]
    assert tp1[0] > tp1[1] > 0 and tp1[2] > tp1[3] > 0
