"""The tiny preset with seeded random weights, shared by the model and runtime tests."""

from dsv4.config import ModelConfig
from dsv4.model import DeepseekV4Model
from dsv4.random_init import init_random_weights


def tiny_model(max_seq_len: int, seed: int) -> DeepseekV4Model:
    return init_random_weights(DeepseekV4Model(ModelConfig.preset("tiny"), max_seq_len=max_seq_len),
                               seed=seed)
