"""Command line: `python -m dsv4 env` (flags) and `python -m dsv4 generate` (the main job)."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from .cli_errors import UsageError


class StderrWarnings(logging.Handler):
    """The packages' warnings (an ignored config key, an unusable prefix-cache file) as one
    `warning: ...` line on stderr, each message once (config.json is read before the estimate
    and again by the loader): the library only logs them, the command line shows them.
    silent: a tensor-parallel rank other than 0, which prints only errors (rank 0 shows the
    warnings, which every rank would repeat)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: set[str] = set()
        self.silent = False

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if not self.silent and message not in self.seen:
            self.seen.add(message)
            print(f"warning: {message}", file=sys.stderr)


WARNINGS = StderrWarnings()


def _cmd_env(args: argparse.Namespace) -> int:
    from . import flags_table

    if args.markdown:
        print(flags_table.docs_table())
        return 0
    rows = flags_table.values_table()
    w = max(len(r[0]) for r in rows)
    vw = max(len(r[1]) for r in rows)
    print(f"{'flag':<{w}}  {'value':<{vw}}  source   meaning")
    for name, value, source, help_ in rows:
        print(f"{name:<{w}}  {value:<{vw}}  {source:<7}  {help_}")
    bad = any(r[1].startswith("ERROR") for r in rows)
    if not bad:
        from .plugins import sglang, vllm

        print("\nserving plugins (what each would replace in the installed engine):")
        for plugin in (sglang, vllm):
            print(f"  {plugin.status()}")
        for line in sglang.monokernel_status():
            print(f"  {line}")
    return 1 if bad else 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from . import cli_generate

    for name in ("batch", "prompt_len", "max_new_tokens", "repeat", "tp"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.prefill_chunk = _prefill_chunk(args.prefill_chunk)
    return cli_generate.run(args)


def _prefill_chunk(text: str | None) -> int | None:
    """--prefill-chunk as the engine takes it: None (follow DSV4_PREFILL_CHUNK), 0 (auto) or
    a token count >= 1."""
    if text is None or text == "auto":
        return None if text is None else 0
    if not text.strip().isdigit() or int(text) < 1:
        raise UsageError(f"--prefill-chunk must be a whole number of tokens >= 1 or auto, got "
                         f"{text!r}")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dsv4", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true",
                        help="show the traceback of an error instead of one line")
    env = sub.add_parser("env", parents=[common],
                         help="print every DSV4_* flag with its value and source")
    env.add_argument("--markdown", action="store_true",
                     help="print the markdown table of docs/flags.md instead")
    env.set_defaults(func=_cmd_env)
    gen = sub.add_parser("generate", parents=[common],
                         help="generate tokens and report prefill and decode speed (default: small "
                         "preset, seeded random weights in the published formats, random "
                         "prompts)")
    src = gen.add_argument_group("model")
    src.add_argument("--model-path", help="checkpoint directory: config.json, *.safetensors and, "
                     "for text, tokenizer.json (default: random weights)")
    src.add_argument("--preset", default="small", help="preset for random weights: small (the "
                     "smallest that runs the published FP8/FP4 formats), tiny (bf16 only), flash "
                     "or pro (default small)")
    src.add_argument("--weights", choices=("native", "bf16"), default=None,
                     help="native: hold and compute with the published FP8/FP4 formats; bf16: "
                     "every quantized weight dequantized to bf16 (default native where the "
                     "config's dims allow it, else bf16)")
    src.add_argument("--force", action="store_true",
                     help="run even when the memory estimate exceeds the device's memory")
    src.add_argument("--tp", type=int, default=1,
                     help="tensor-parallel ranks, one process each: launch with torchrun "
                     "--nproc-per-node N -m dsv4 generate --tp N (default 1: this process alone)")
    src.add_argument("--device-memory", type=float, default=None, metavar="GIB",
                     help="the memory one device has, in GiB, for the estimate (default: this "
                     "machine's device)")
    src.add_argument("--estimate-only", action="store_true",
                     help="print the per-rank memory estimate and whether it fits, then stop "
                     "(no weights are made; needs no torchrun)")
    inp = gen.add_argument_group("prompts (default: --batch random prompts of --prompt-len ids)")
    one = inp.add_mutually_exclusive_group()
    one.add_argument("--prompt", help="one text prompt (needs the checkpoint's tokenizer)")
    one.add_argument("--prompt-ids", help="one prompt as comma-separated token ids: 1,2,3")
    one.add_argument("--prompt-file", help="one prompt per line, token ids or text")
    inp.add_argument("--batch", type=int, default=4, help="random prompts (default 4)")
    inp.add_argument("--prompt-len", type=int, default=None,
                     help="ids per random prompt (default 32; 300 with --prefix-cache, so that "
                     "whole 256-token pages exist to reuse)")
    out = gen.add_argument_group("generation")
    out.add_argument("--max-new-tokens", type=int, default=16,
                     help="tokens generated per prompt, the first included (default 16)")
    out.add_argument("--temperature", type=float, default=0.0,
                     help="0 = greedy (default, deterministic); > 0 samples")
    out.add_argument("--top-k", type=int, default=0, help="sample among the k most likely "
                     "(default 0 = all)")
    out.add_argument("--top-p", type=float, default=1.0,
                     help="sample among the most likely tokens holding this probability "
                     "(default 1.0 = all)")
    out.add_argument("--seed", type=int, default=0,
                     help="seed of the random weights, the random prompts and the sampling "
                     "(default 0)")
    out.add_argument("--ignore-eos", action="store_true",
                     help="do not stop at the config's end token")
    run = gen.add_argument_group("run")
    run.add_argument("--graph", action=argparse.BooleanOptionalAction, default=None,
                     help="capture and replay decode graphs (default: DSV4_GRAPH)")
    run.add_argument("--threads", type=int, default=0,
                     help="torch CPU threads (default: 1 on a CPU, where the small presets' ops "
                     "are too small to share)")
    run.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                     help="reuse the KV of cached prompt prefixes (default: DSV4_PREFIX_CACHE)")
    run.add_argument("--prefix-cache-dir", default=None,
                     help="file tier of the prefix cache (default: DSV4_PREFIX_CACHE_DIR, "
                     "empty = host memory only)")
    run.add_argument("--prefill-chunk", default=None, metavar="N",
                     help="prefill a prompt in chunks of at most N tokens, N >= 1, or auto; "
                     "each step's token budget, decodes first (default: DSV4_PREFILL_CHUNK, "
                     "0 = auto: sized from the device's memory)")
    run.add_argument("--repeat", type=int, default=1,
                     help="run the prompt set this many times in one engine (default 1); the "
                     "JSON report lists each pass under 'passes'")
    run.add_argument("--json", action="store_true",
                     help="also print the report as one JSON object on the last line")
    run.add_argument("--quiet", action="store_true", help="no progress bars")
    gen.set_defaults(func=_cmd_generate)
    return p


def peer_failure_line(e: BaseException) -> str:
    """One line for a collective that failed because another tensor-parallel rank stopped."""

    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    return (f"rank {os.environ.get('RANK', '?')}: another tensor-parallel rank stopped or stopped "
            f"answering, so this rank ends too ({first})")


def main(argv: list[str] | None = None) -> int:
    """Mistakes a user can make (bad values, missing or corrupt files, a model that does not fit)
    end in one line on stderr and exit status 2; --debug shows the traceback instead."""
    args = build_parser().parse_args(argv)
    loggers = [logging.getLogger(package) for package in ("dsv4", "mem_pool", "hip_kernels")]
    WARNINGS.seen.clear()
    WARNINGS.silent = os.environ.get("RANK", "0") != "0"     # torchrun's rank of this process
    for logger in loggers:
        logger.addHandler(WARNINGS)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # UsageError, flag, config and checkpoint errors
        if args.debug:
            raise
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"error: {message}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from .parallel import is_peer_failure

        if args.debug or not is_peer_failure(e):
            raise
        print(f"error: {peer_failure_line(e)}", file=sys.stderr)
        return 3
    finally:
        for logger in loggers:
            logger.removeHandler(WARNINGS)


if __name__ == "__main__":
    sys.exit(main())
