"""What ``Engine.generate`` refuses before anything is allocated: mistakes of the call itself
(``check_call`` raises ValueError) and requests that cannot run at all (``request_error`` gives
the reason, and that request alone fails)."""

from __future__ import annotations


def check_call(prompts, max_new_tokens, forced_tokens, vocab_size: int) -> None:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompt_token_ids must be a non-empty list of prompts (lists of ids)")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or (
            max_new_tokens < 1):
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if forced_tokens is not None and (len(forced_tokens) != len(prompts) or any(
            len(f) < max_new_tokens for f in forced_tokens)):
        raise ValueError("forced_tokens needs one list of >= max_new_tokens tokens per prompt")
    for i, forced in enumerate(forced_tokens or ()):
        bad = bad_token(forced, vocab_size)
        if bad is not None:
            raise ValueError(f"forced_tokens[{i}] holds {bad!r}: token ids are ints in "
                             f"0..{vocab_size - 1}")


def bad_token(ids, vocab_size: int):
    """The first id that is not an int of the vocabulary (bools and floats included), or None
    when all are."""
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            return t
    return None


def request_error(i: int, prompt, max_new_tokens: int, vocab_size: int, max_context_len: int,
                  page_size: int, pool_pages: int) -> str | None:
    """Why prompt i cannot run at all (a per-request failure), or None. pool_pages: the pages of
    the whole pool, each of page_size tokens."""
    if not isinstance(prompt, (list, tuple)) or not prompt:
        return (f"prompt_token_ids[{i}] must be a non-empty list of token ids, got "
                f"{type(prompt).__name__}{' (empty)' if isinstance(prompt, list) else ''}")
    bad = bad_token(prompt, vocab_size)
    if bad is not None:
        return (f"prompt_token_ids[{i}] holds {bad!r}: token ids are ints in "
                f"0..{vocab_size - 1}")
    longest = len(prompt) + max_new_tokens - 1
    if longest > max_context_len:
        return (f"prompt_token_ids[{i}]: prompt + max_new_tokens - 1 = {longest} tokens "
                f"exceed max_context_len={max_context_len}")
    need = -(-len(prompt) // page_size)
    if need > pool_pages:
        return (f"prompt_token_ids[{i}]: a prompt of {len(prompt)} tokens needs {need} pages "
                f"of {page_size} tokens; the whole pool has {pool_pages}")
    return None
