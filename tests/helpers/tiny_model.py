"""The tiny preset with seeded random weights, seeded prompts for it, and the check that an engine
has given every page and request slot back; shared by the model and runtime tests."""

import torch

from dsv4.config import ModelConfig
from dsv4.model import DeepseekV4Model
from dsv4.random_init import init_random_weights


def tiny_model(max_seq_len: int, seed: int) -> DeepseekV4Model:
    return init_random_weights(DeepseekV4Model(ModelConfig.preset("tiny"), max_seq_len=max_seq_len),
                               seed=seed)


def prompts(lens: list[int], seed: int = 0) -> list[list[int]]:
    """Random token ids of the tiny preset's vocabulary, a prompt of each length."""
    g = torch.Generator().manual_seed(seed)
    vocab = ModelConfig.preset("tiny").vocab_size
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lens]


def all_free(engine) -> bool:
    """Every full and SWA token and every request slot of the engine is free again."""
    a = engine.allocator
    return (a.full_available_size() == a.size_full and a.swa_available_size() == a.size_swa
            and engine.req_to_token_pool.available() == engine.max_batch)
