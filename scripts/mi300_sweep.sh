#!/usr/bin/env bash
# Run every benchmark on an MI300 (or any) machine and collect the results in one directory:
#
#   results/<UTC timestamp>/
#     env.json                      python scripts/bench_common.py (versions, GPU, flags)
#     rocm-smi.txt, rocminfo.txt,   raw tool output, when the tools exist
#     hipconfig.txt
#     bench_swa_translation.json    scripts/bench_swa_translation.py
#     bench_set_kv.json             scripts/bench_set_kv.py
#     bench_decode_kernels.json     scripts/bench_decode_kernels.py (attention, indexer scores)
#     bench_decode.json             scripts/bench_decode.py (flash-shaped layers on a GPU)
#     bench_decode_pro.json         scripts/bench_decode.py --preset pro (GPU only)
#     bench_long_context.json       scripts/bench_long_context.py (one request, prompt lengths)
#     bench_sglang_plugin.json      scripts/bench_sglang_plugin.py (when SGLang is installed)
#     *.png                         scripts/plot_results.py (skipped without matplotlib)
#     summary.md                    scripts/summarize_results.py (numbers beside the anchors)
#     sweep.log                     what ran, and each step's exit status
#
# Usage: scripts/mi300_sweep.sh [--quick] [--out-root DIR] [--dry-run] [-h|--help]
#   --quick      pass --quick to every benchmark (a smoke run, minutes)
#   --out-root   parent directory of the timestamped results directory (default: results)
#   --dry-run    print the commands, run nothing, create nothing
# A failing benchmark does not stop the others; the exit status is 1 if any step failed.
# Extra options for bench_decode: set BENCH_DECODE_ARGS / BENCH_DECODE_PRO_ARGS (e.g. "--layers 8");
# for bench_long_context, BENCH_LONG_CONTEXT_ARGS (e.g. "--prompt-lens 1024,16384,131072,1048576").
set -uo pipefail

usage() { sed -n '2,/^set -uo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; }

quick=()
out_root=results
dry_run=0
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=(--quick) ;;
    --out-root) shift; out_root="${1:?--out-root needs a directory}" ;;
    --dry-run) dry_run=1 ;;
    -h|--help) usage; exit 0 ;;
    *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

cd "$(dirname "$0")/.."
py="${PYTHON:-python}"
dir="$out_root/$(date -u +%Y%m%dT%H%M%SZ)"
failed=0

log() { if [ "$dry_run" = 1 ]; then echo "$*"; else echo "$*" | tee -a "$dir/sweep.log"; fi; }

# step NAME CMD...: run CMD (or print it), log its status, remember a failure.
step() {
  local name="$1"; shift
  log "+ $*"
  [ "$dry_run" = 1 ] && return 0
  "$@"
  local rc=$?
  log "  $name: exit $rc"
  [ "$rc" = 0 ] || failed=1
}

# capture FILE CMD...: save a tool's output when the tool exists.
capture() {
  local file="$1"; shift
  command -v "$1" >/dev/null 2>&1 || return 0
  log "+ $* > $dir/$file"
  [ "$dry_run" = 1 ] || "$@" > "$dir/$file" 2>&1 || true
}

[ "$dry_run" = 1 ] || mkdir -p "$dir"
log "results directory: $dir"

step env sh -c "$py scripts/bench_common.py > '$dir/env.json'"
capture rocm-smi.txt rocm-smi --showproductname --showdriverversion --showmeminfo vram
capture rocminfo.txt rocminfo
capture hipconfig.txt hipconfig --version

gpu=$($py -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)

step swa_translation "$py" scripts/bench_swa_translation.py "${quick[@]}" \
  --out "$dir/bench_swa_translation.json"
if [ -f scripts/bench_set_kv.py ]; then
  step set_kv "$py" scripts/bench_set_kv.py "${quick[@]}" --out "$dir/bench_set_kv.json"
fi
step decode_kernels "$py" scripts/bench_decode_kernels.py "${quick[@]}" \
  --out "$dir/bench_decode_kernels.json"
# shellcheck disable=SC2086  # the *_ARGS variables are word lists on purpose
step decode "$py" scripts/bench_decode.py "${quick[@]}" ${BENCH_DECODE_ARGS:-} \
  --out "$dir/bench_decode.json"
if [ "$gpu" = 1 ]; then
  # Pro layers are 7168 wide with 384 experts (~50 GB of bf16 MoE weights per layer):
  # 4 layers with 96 experts keep the per-token work and fit one GPU.
  # shellcheck disable=SC2086
  step decode_pro "$py" scripts/bench_decode.py "${quick[@]}" --preset pro --layers 4 \
    --experts 96 ${BENCH_DECODE_PRO_ARGS:-} --out "$dir/bench_decode_pro.json"
fi

# shellcheck disable=SC2086
step long_context "$py" scripts/bench_long_context.py "${quick[@]}" ${BENCH_LONG_CONTEXT_ARGS:-} \
  --out "$dir/bench_long_context.json"

# find_spec, not an import: importing SGLang takes tens of seconds, and a dry run prints only.
if $py -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)" \
    2>/dev/null; then
  step sglang_plugin "$py" scripts/bench_sglang_plugin.py "${quick[@]}" \
    --out "$dir/bench_sglang_plugin.json"
fi

step plots "$py" scripts/plot_results.py "$dir"
step summary "$py" scripts/summarize_results.py "$dir"

log "done: $dir (failures: $failed)"
exit "$failed"
