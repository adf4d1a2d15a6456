"""bench/bench_tests.py: what it records of each test (its CPU seconds, and when it ran) and what it says of a slow one
(the files whose tests ran beside it)."""

import time

from bench import bench_tests


def test_beside_sums_the_time_each_files_tests_ran_alongside_longest_first():
    spans = {"tests/test_a.py::slow": [10.0, 30.0],
             "tests/test_a.py::next": [30.0, 40.0],  # its process's next test: after it
             "tests/test_b.py::x": [5.0, 15.0],  # 5 s of it beside
             "tests/test_b.py::y": [15.0, 20.0],  # 5 s
             "tests/test_c.py::z": [18.0, 50.0],  # 12 s
             "tests/test_d.py::after": [31.0, 35.0]}  # none
    assert list(bench_tests.beside(spans, "tests/test_a.py::slow").items()) == [("tests/test_c.py", 12.0),
                                                                              ("tests/test_b.py", 10.0)]
    assert bench_tests.beside(spans, "tests/test_d.py::after") == {"tests/test_a.py": 4.0, "tests/test_c.py": 4.0}


def test_the_run_records_each_tests_cpu_and_when_it_ran(tmp_path):
    (tmp_path / "test_two.py").write_text("import time\n\n\ndef test_busy():\n    end = time.process_time() + 0.3\n"
                                          "    while time.process_time() < end:\n        pass\n\n\n"
                                          "def test_idle():\n    time.sleep(0.3)\n")
    before = time.time()
    result = bench_tests.run_suite(["-o", "addopts=", "-p", "no:xdist", str(tmp_path / "test_two.py")],
                                   str(tmp_path / "log"))
    assert result["exit_code"] == 0 and result["processes"] == 1, result
    assert result["tests_cpu"].keys() == result["spans"].keys() and len(result["spans"]) == 2, result
    cpu = {test.split("::")[1]: seconds for test, seconds in result["tests_cpu"].items()}
    assert cpu["test_busy"] >= 0.3 and cpu["test_idle"] < 0.2, cpu
    spans = {test.split("::")[1]: span for test, span in result["spans"].items()}
    (busy_start, busy_end), (idle_start, idle_end) = spans["test_busy"], spans["test_idle"]
    assert before < busy_start < busy_end <= idle_start < idle_end < time.time()
    assert idle_end - idle_start >= 0.3
