"""Mutation score per package (hip_kernels, mem_pool, dsv4) on a seeded sample of mutants.

Run by hand, never in CI. Needs mutmut at the version pinned in requirements/mutation.txt:

    pip install -r requirements/mutation.txt
    python scripts/mutation_score.py --sample 35 --seeds 2,3

How it works. mutmut (configured in pyproject.toml, [tool.mutmut]) copies the three packages
into ./mutants with every mutant of every function compiled in beside the original, plus the
tests and the files they read (scripts/, README.md, docs/, requirements/), and runs pytest in
./mutants. Its first run goes through the whole suite once to learn which tests call which
function (kept in ./mutants and reused while the code and these options stay the same). Each
sampled mutant then runs in a fresh process with only the tests that call its function,
fastest first, stopping at the first failure. The sample is drawn per package from all of the
package's mutants with a fixed seed: the same seed gives the same mutants. Several seeds
(--seeds 2,3) draw one sample each; their mutants are checked in one mutmut run (a mutant in two
samples is checked once), and the report shows the seeds together and each seed alone.

What a run prints: one row per package (mutants run, killed, survived, no tests, timeout,
suspicious, score) over all the seeds' samples (a mutant drawn by two seeds counts once), one
row per package and seed, then the names of the surviving mutants; --diff prints each
survivor's diff as well, and `mutmut show NAME` prints one later. --report-only prints the
tables again for the given seeds, from the checks already done in ./mutants.
After writing tests for the survivors, --recheck runs the same seeds again but checks only the
mutants no test caught last time; the new tests are traced first (mutmut adds new tests to its
stats without rerunning the suite).
  killed      a test failed with the mutant in place
  survived    every test that calls the function passed
  no tests    no test calls the function in the pytest process (e.g. GPU-only code, or code
              reached only through a subprocess, see below)
  timeout     its tests ran longer than FACTOR x (their unmutated time + TIMEOUT s)
  suspicious  anything else (crash, killed by a signal, interrupted)
  score       (killed + timeout) / run; "tested" leaves the no-tests mutants out

Subprocess tests. Tests that start Python subprocesses (`python -m dsv4`, the benchmark
scripts, fresh-interpreter import checks) are deselected by default: mutmut cannot see which
functions a subprocess calls, so they would cost minutes of every run while being picked for
almost no mutant. --keep-subprocess-tests keeps them; PYTHONPATH points at ./mutants either way,
so a subprocess imports the mutated packages and the mutant named in MUTANT_UNDER_TEST.
Tests that count Python frames (FRAME_COUNTING_TESTS) are always deselected: mutmut's
trampolines add frames. The first run needs a green suite and stops at the first failing test
(mutmut prints nothing about it): run the failing area's tests first when others are editing.

mutmut 3 mutates function bodies only: module-level code and decorated functions (Triton
kernels, lru_cache, properties) are left alone. OMP_NUM_THREADS defaults to 1 here: one mutant
at a time (--jobs) on one thread keeps the run to one core.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import io
import os
import random
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hip_kernels", "mem_pool", "dsv4")
PIN_FILE = ROOT / "requirements" / "mutation.txt"

# Node id prefixes of the tests that start Python subprocesses (deselected unless
# --keep-subprocess-tests).
SUBPROCESS_TESTS = (
    "tests/runtime/test_runtime_cli.py::test_readme_main_command",
    "tests/runtime/test_runtime_cli.py::test_debug_shows_the_traceback",
    "tests/kernels/test_bench_set_kv.py",
    "tests/kernels/test_triton_aot.py",
    "tests/runtime/test_bench_scripts.py::test_every_script_has_help",
    "tests/runtime/test_bench_scripts.py::test_decode_quick",
    "tests/runtime/test_bench_scripts.py::test_swa_translation_quick",
    "tests/runtime/test_bench_scripts.py::test_sglang_plugin_quick",
    "tests/runtime/test_bench_scripts.py::test_sweep_script",
    "tests/runtime/test_flags.py::test_update_flags_doc",
    "tests/model/test_checkpoint.py::test_lazy_exports_keep_import_cheap",
    "tests/runtime/test_imports.py::test_packages_import_without_triton",
    "tests/kernels/test_set_kv_triton.py::test_triton_backend_on_cpu_needs_the_interpreter",
    "tests/plugins/test_plugin_sglang.py::test_loader_in_a_fresh_process",
    "tests/plugins/test_plugin_vllm.py::test_vllm_loader",
)

# Tests that cannot pass under mutmut: they count the Python frames of a call, and mutmut's
# trampoline adds frames to every mutated function. Always deselected.
FRAME_COUNTING_TESTS = (
    "tests/model/test_model_window_store.py::"
    "test_the_window_store_reaches_its_kernel_in_four_frames",
)

COLUMNS = ("run", "killed", "survived", "no tests", "timeout", "suspicious")


def seed_list(text):
    """'2,3' -> [2, 3]: the seeds in the order given, each once."""
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--seeds: expected integers separated by commas (e.g. 2,3), got {text!r}") from None
    return list(dict.fromkeys(seeds))


def parse_args(argv):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--packages", nargs="+", choices=PACKAGES, default=list(PACKAGES),
                        help="packages to mutate (default: all three)")
    parser.add_argument("--sample", type=int, default=35, metavar="N",
                        help="mutants drawn per package (default 35; 0 = every mutant, "
                             "which takes days on a CPU)")
    parser.add_argument("--seeds", type=seed_list, default=[0], metavar="S[,S...]",
                        help="seeds of the samples, comma-separated, e.g. 2,3 (default 0); "
                             "--seed 2 is the same as --seeds 2")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="S",
                        help="seconds a mutant's tests may take beyond their unmutated time, "
                             "before the factor (default 60)")
    parser.add_argument("--timeout-factor", type=float, default=2.0, metavar="FACTOR",
                        help="a mutant times out after FACTOR x (unmutated time + S) "
                             "(default 2)")
    parser.add_argument("--jobs", type=int, default=1,
                        help="mutants tested at once (default 1)")
    parser.add_argument("--keep-subprocess-tests", action="store_true",
                        help="also run the tests that start subprocesses (see above)")
    parser.add_argument("--skip-clean-run", action="store_true",
                        help="skip mutmut's pass of the sampled mutants' tests on the unmutated "
                             "code (it checks they pass first; with a large sample it is most "
                             "of the suite, ~45 min on 2 cores). Only after a green run of the "
                             "same commit, e.g. the stats pass of the same ./mutants")
    parser.add_argument("--recheck", action="store_true",
                        help="check again only the sampled mutants no test caught last time "
                             "(survived, no tests, suspicious, never checked), e.g. after adding "
                             "tests; the caught ones keep their result (mutmut itself resets the "
                             "mutants of a function whose code changed)")
    parser.add_argument("--diff", action="store_true", help="print each survivor's diff")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing; print the tables of these seeds' samples from "
                             "the checks already done")
    return parser.parse_args(argv)


def check_mutmut_version():
    pinned = re.search(r"^mutmut==(\S+)", PIN_FILE.read_text(), re.M).group(1)
    try:
        installed = importlib.metadata.version("mutmut")
    except importlib.metadata.PackageNotFoundError:
        sys.exit(f"mutmut is not installed: pip install -r {PIN_FILE.relative_to(ROOT)}")
    if installed != pinned:
        sys.exit(f"this script drives mutmut {pinned} (it uses mutmut's own functions to list "
                 f"the mutants); installed: {installed}. pip install -r "
                 f"{PIN_FILE.relative_to(ROOT)}")


def configure(args):
    """Settings of this run on top of pyproject.toml's [tool.mutmut]. Call after chdir(ROOT):
    mutmut reads its configuration from the current directory."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mutants = str(ROOT / "mutants")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (mutants, os.environ.get("PYTHONPATH")) if p)

    from mutmut.configuration import config

    cfg = config()
    cfg.timeout_constant = args.timeout
    cfg.timeout_multiplier = args.timeout_factor
    deselect = [*FRAME_COUNTING_TESTS, *(() if args.keep_subprocess_tests else SUBPROCESS_TESTS)]
    cfg.pytest_add_cli_args = [*cfg.pytest_add_cli_args, *(f"--deselect={t}" for t in deselect)]


def generate_mutants(jobs):
    """Write ./mutants the way `mutmut run` starts (it skips files already up to date)."""
    from mutmut.__main__ import copy_also_copy_files, copy_src_dir, create_mutants
    from mutmut.utils.file_utils import setup_source_paths

    print("generating mutants (the first time: about a minute) ...", flush=True)
    with contextlib.redirect_stdout(io.StringIO()):
        copy_src_dir()
        copy_also_copy_files()
        setup_source_paths()
        create_mutants(jobs)


def exit_codes():
    """{mutant name: mutmut's exit code of its last check, None if never checked}."""
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.utils.file_utils import walk_mutatable_files

    codes = {}
    for path in walk_mutatable_files():
        data = SourceFileMutationData(path=path)
        data.load()
        codes.update(data.exit_code_by_key)
    return codes


def package_of(name):
    return name.split(".", 1)[0]


def draw_sample(names, packages, size, seed):
    """`size` names per package, drawn the same way whichever other packages are chosen."""
    sample = []
    for package in packages:
        pool = sorted(n for n in names if package_of(n) == package)
        if size and size < len(pool):
            pool = random.Random(f"{seed}-{package}").sample(pool, size)
        sample += pool
    return sample


def by_file_fastest_first(tests, duration):
    """The tests of one file together, the files and the tests in each fastest first."""
    def file_of(test):
        return test.split("::")[0]

    file_time = Counter()
    for test in tests:
        file_time[file_of(test)] += duration.get(test, 0.0)
    return sorted(tests, key=lambda t: (file_time[file_of(t)], file_of(t), duration.get(t, 0.0)))


def keep_files_together():
    """mutmut passes pytest a mutant's tests in set order, and pytest runs them in that order,
    setting a file's module-scoped fixtures up again each time its tests come back: slow, and
    fatal for tests/kernels/test_set_kv_host_harness.py, whose fixture builds and loads a C++ extension
    (a second load in one process aborts it). Order them by file, fastest first, with -x
    stopping a killed mutant early."""
    from mutmut.runners.harness import PytestRunner
    from mutmut.state import state

    pytest_args = PytestRunner._pytest_args_regular_run

    def pytest_args_by_file(self, tests):
        return pytest_args(self, by_file_fastest_first(tests, state().duration_by_test))

    PytestRunner._pytest_args_regular_run = pytest_args_by_file


def skip_clean_run():
    """Report every clean run as passed (exit code 0) without running it."""
    from mutmut.workers import isolation

    for runner in (isolation.MutantRunner, isolation.ForkServerRunner, isolation.ForkRunner):
        runner.run_clean_tests = lambda self, tests=None: 0


def run_mutmut(names, jobs, skip_clean):
    from mutmut.__main__ import cli

    keep_files_together()
    if skip_clean:
        skip_clean_run()
    cli.main(["run", "--max-children", str(jobs), *names], prog_name="mutmut",
             standalone_mode=False)


def column_of(status):
    if status in ("killed", "survived", "no tests", "timeout"):
        return status
    return "suspicious"


def percent(part, whole):
    return f"{100 * part / whole:.0f}%" if whole else "-"


def tally(names, status):
    """{package: Counter of the COLUMNS} over `names` (each counted once), packages in the
    order they first appear."""
    counts = {}
    for name in dict.fromkeys(names):
        c = counts.setdefault(package_of(name), Counter())
        c["run"] += 1
        c[column_of(status[name])] += 1
    return counts


def table(rows):
    """The lines of a table of (label, Counter) rows: the COLUMNS, then the score (killed +
    timeout over run) and the tested score (the same over run less no tests)."""
    width = max([12, *(len(label) + 1 for label, _ in rows)])
    header = f"{'package':{width}s}" + "".join(f"{c:>11s}" for c in COLUMNS)
    header += "      score     tested"
    lines = [header, "-" * len(header)]
    for label, c in rows:
        caught = c["killed"] + c["timeout"]
        tested = c["run"] - c["no tests"]
        lines.append(f"{label:{width}s}" + "".join(f"{c[col]:11d}" for col in COLUMNS)
                     + f"{percent(caught, c['run']):>11s}{percent(caught, tested):>11s}")
    return lines


def report_tables(samples, status):
    """The report's tables for {seed: sample}: all the seeds together, then (with more than one
    seed) each package under each seed."""
    every = [name for sample in samples.values() for name in sample]
    seeds = ", ".join(str(seed) for seed in samples)
    lines = [f"seeds {seeds} together ({len(set(every))} mutants)",
             *table(tally(every, status).items())]
    if len(samples) > 1:
        rows = [(f"{package} seed {seed}", c)
                for seed, sample in samples.items()
                for package, c in tally(sample, status).items()]
        lines += ["", "each seed", *table(rows)]
    return lines


def not_caught(names, status):
    """The names whose last check did not catch the mutant (caught: killed or timeout)."""
    return [n for n in names if column_of(status[n]) not in ("killed", "timeout")]


def statuses(names):
    """{name: mutmut's status word of its last check} ('not checked' if never checked)."""
    from mutmut.stats import status_by_exit_code

    codes = exit_codes()
    return {name: status_by_exit_code[codes.get(name)] for name in names}


def print_report(samples, show_diff):
    from mutmut.mutation.diff_apply import find_mutant, get_diff_for_mutant

    every = list(dict.fromkeys(name for sample in samples.values() for name in sample))
    status = statuses(every)
    print("\n" + "\n".join(report_tables(samples, status)))
    unchecked = [n for n in every if status[n] == "not checked"]
    if unchecked:
        print(f"\n{len(unchecked)} mutants were never checked (run interrupted?); "
              "they count as suspicious")

    for label in ("survived", "no tests", "timeout", "suspicious"):
        names = [n for n in every if column_of(status[n]) == label]
        if not names:
            continue
        print(f"\n{label} ({len(names)}):")
        for name in names:
            print(f"  {name}" + ("" if label != "suspicious" else f"  [{status[name]}]"))
            if show_diff and label in ("survived", "no tests"):
                diff = get_diff_for_mutant(name, path=find_mutant(name).path)
                print("    " + diff.strip().replace("\n", "\n    "))
    if not show_diff:
        print("\nA mutant's diff: mutmut show NAME (or rerun with --report-only --diff)")


def main(argv=None):
    args = parse_args(argv)
    check_mutmut_version()
    os.chdir(ROOT)
    configure(args)
    if args.report_only:
        if not Path("mutants").is_dir():
            sys.exit("no earlier run: ./mutants is missing")
    else:
        generate_mutants(args.jobs)
    names = exit_codes()
    samples = {seed: draw_sample(names, args.packages, args.sample, seed) for seed in args.seeds}
    if not args.report_only:
        every = list(dict.fromkeys(name for sample in samples.values() for name in sample))
        print(f"{len(every)} mutants sampled (seeds {', '.join(map(str, args.seeds))}) "
              f"from {', '.join(args.packages)}")
        if args.recheck:
            every = not_caught(every, statuses(every))
            print(f"checking again the {len(every)} that no test caught last time")
        if every:
            run_mutmut(every, args.jobs, args.skip_clean_run)
    print_report(samples, args.diff)


if __name__ == "__main__":
    main()
