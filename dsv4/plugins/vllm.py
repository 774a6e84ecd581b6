"""vLLM plugin (placeholder while being written)."""


def status() -> str:
    return "vllm: not checked"


def register() -> None:
    return None
