"""scripts/mutation_score.py's seeds and tables, in-process (mutmut itself is not needed: the
tables are built from a {mutant name: status} map)."""

import argparse

import pytest
from bench_runner import SCRIPTS  # noqa: F401  (puts scripts/ on the import path)

import mutation_score as ms  # noqa: E402

STATUS = {
    "hip_kernels.a.x__mutmut_1": "killed",
    "hip_kernels.a.x__mutmut_2": "survived",
    "hip_kernels.a.x__mutmut_3": "no tests",
    "hip_kernels.a.x__mutmut_4": "timeout",
    "mem_pool.b.y__mutmut_1": "killed",
    "mem_pool.b.y__mutmut_2": "segfault",
    "dsv4.c.z__mutmut_1": "killed",
}


def test_seeds_parse_in_order_once_each():
    assert ms.seed_list("3,2,3") == [3, 2]
    assert ms.parse_args(["--seeds", "2,3"]).seeds == [2, 3]
    assert ms.parse_args(["--seed", "4"]).seeds == [4]
    assert ms.parse_args([]).seeds == [0]
    with pytest.raises(argparse.ArgumentTypeError, match="--seeds: expected integers.*'2;3'"):
        ms.seed_list("2;3")


def test_tally_counts_each_mutant_once_per_package():
    counts = ms.tally([*STATUS, "hip_kernels.a.x__mutmut_1"], STATUS)
    assert list(counts) == ["hip_kernels", "mem_pool", "dsv4"]
    assert counts["hip_kernels"] == {"run": 4, "killed": 1, "survived": 1, "no tests": 1,
                                     "timeout": 1}
    assert counts["mem_pool"] == {"run": 2, "killed": 1, "suspicious": 1}


def row(lines, label):
    (line,) = [line for line in lines if line.startswith(label + " ")]
    return line.split()[len(label.split()):]


def test_table_scores_count_timeouts_as_caught_and_leave_no_tests_out_of_tested():
    lines = ms.table(ms.tally(STATUS, STATUS).items())
    assert lines[0].split()[:2] == ["package", "run"]
    assert lines[0].split()[-2:] == ["score", "tested"]
    # run killed survived no-tests timeout suspicious score tested
    assert row(lines, "hip_kernels") == ["4", "1", "1", "1", "1", "0", "50%", "67%"]
    assert row(lines, "mem_pool") == ["2", "1", "0", "0", "0", "1", "50%", "50%"]
    assert row(lines, "dsv4") == ["1", "1", "0", "0", "0", "0", "100%", "100%"]


def test_a_package_with_only_untested_mutants_has_no_tested_score():
    lines = ms.table([("dsv4", ms.tally(["dsv4.q__mutmut_1"], {"dsv4.q__mutmut_1": "no tests"})
                       ["dsv4"])])
    assert row(lines, "dsv4")[-2:] == ["0%", "-"]


def test_several_seeds_give_a_combined_table_and_one_row_per_seed():
    samples = {2: ["hip_kernels.a.x__mutmut_1", "hip_kernels.a.x__mutmut_2"],
               3: ["hip_kernels.a.x__mutmut_2", "hip_kernels.a.x__mutmut_3",
                   "mem_pool.b.y__mutmut_1"]}
    lines = ms.report_tables(samples, STATUS)
    assert lines[0] == "seeds 2, 3 together (4 mutants)"
    split = lines.index("each seed")
    together, each = lines[:split], lines[split:]
    # the mutant both seeds drew counts once together, once under each seed
    assert row(together, "hip_kernels")[:4] == ["3", "1", "1", "1"]
    assert row(together, "mem_pool")[:2] == ["1", "1"]
    assert row(each, "hip_kernels seed 2") == ["2", "1", "1", "0", "0", "0", "50%", "50%"]
    assert row(each, "hip_kernels seed 3") == ["2", "0", "1", "1", "0", "0", "0%", "0%"]
    assert row(each, "mem_pool seed 3")[:2] == ["1", "1"]
    assert not [line for line in each if line.startswith("mem_pool seed 2")]


def test_one_seed_prints_no_per_seed_table():
    lines = ms.report_tables({5: ["dsv4.c.z__mutmut_1"]}, STATUS)
    assert lines[0] == "seeds 5 together (1 mutants)"
    assert "each seed" not in lines


def test_samples_are_the_same_whichever_packages_are_chosen():
    names = [f"{p}.m.f__mutmut_{i}" for p in ms.PACKAGES for i in range(20)]
    alone = ms.draw_sample(names, ["mem_pool"], 5, seed=2)
    together = ms.draw_sample(names, list(ms.PACKAGES), 5, seed=2)
    assert len(alone) == 5 and set(alone) < set(together)
    assert ms.draw_sample(names, ["mem_pool"], 5, seed=3) != alone
    assert len(ms.draw_sample(names, ["dsv4"], 0, seed=2)) == 20


def test_the_clean_run_is_kept_unless_skipped():
    assert ms.parse_args([]).skip_clean_run is False
    assert ms.parse_args(["--skip-clean-run"]).skip_clean_run is True


def test_skipping_the_clean_run_reports_it_passed_without_running_a_test(monkeypatch):
    pytest.importorskip("mutmut")
    from mutmut.workers import isolation

    runners = (isolation.MutantRunner, isolation.ForkServerRunner, isolation.ForkRunner)
    for runner in runners:  # restored after the test
        monkeypatch.setattr(runner, "run_clean_tests", runner.run_clean_tests)
    ms.skip_clean_run()
    for runner in runners:
        # self is never touched: no child process, no pytest
        assert runner.run_clean_tests(None, ["tests/x.py::test_fails"]) == 0


def test_a_recheck_runs_again_only_what_no_test_caught():
    status = {**STATUS, "dsv4.c.z__mutmut_2": "not checked"}
    assert ms.not_caught(list(status), status) == [
        "hip_kernels.a.x__mutmut_2", "hip_kernels.a.x__mutmut_3", "mem_pool.b.y__mutmut_2",
        "dsv4.c.z__mutmut_2"]
    assert ms.parse_args(["--recheck"]).recheck and not ms.parse_args([]).recheck
