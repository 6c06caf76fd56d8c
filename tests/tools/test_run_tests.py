"""tools/run_tests.sh runs the paths it is given, and all of tests/ only when it is given none:
pytest options and their values pass through and never count as paths."""

import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_args(*argv, workers="0"):
    env = dict(os.environ, RUN_TESTS_DRY_RUN="1", TEST_WORKERS=workers)
    out = subprocess.run(["bash", "tools/run_tests.sh", *argv], cwd=ROOT, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


@pytest.mark.parametrize(
    "argv, expected",
    [
        ([], ["tests"]),
        (["tests/data"], ["tests/data"]),
        (["tests/data", "tests/tools/test_plot.py::test_x"], ["tests/data", "tests/tools/test_plot.py::test_x"]),
        (["-k", "topology"], ["tests", "-k", "topology"]),
        (["-k", "tests", "-x"], ["tests", "-k", "tests", "-x"]),
        (["-x", "tests/data", "-k", "idx"], ["-x", "tests/data", "-k", "idx"]),
        (["--maxfail", "2", "--tb=short"], ["tests", "--maxfail", "2", "--tb=short"]),
    ],
)
def test_paths_given_are_the_paths_run(argv, expected):
    assert pytest_args(*argv) == expected


def test_the_whole_suite_runs_a_file_per_worker():
    assert pytest_args(workers="2") == ["-n", "2", "--dist", "loadfile", "tests"]
    assert pytest_args("-k", "x", workers="2") == ["-n", "2", "--dist", "loadfile", "tests", "-k", "x"]
    assert pytest_args("-n", "3", workers="2") == ["tests", "-n", "3"]  # the caller's own count
    assert pytest_args("tests/data", workers="2") == ["tests/data"]  # given paths: in this process


def test_ci_runs_the_whole_suite():
    text = open(os.path.join(ROOT, ".ci", "run")).read()
    assert "exec bash tools/run_tests.sh\n" in text


def test_lint_phase_runs_the_type_checker_and_the_local_hooks():
    import yaml

    script = open(os.path.join(ROOT, "tools", "run_tests.sh")).read()
    lint = script[script.index("bash tools/setup_env.sh") : script.index("exec ")]
    assert ".venv/bin/python -m mypy" in lint and "pre-commit run --all-files" in lint
    with open(os.path.join(ROOT, ".pre-commit-config.yaml")) as f:
        repos = yaml.safe_load(f)["repos"]
    assert [r["repo"] for r in repos] == ["local"]  # nothing fetched: CI has no network
    hooks = {h["id"]: h for r in repos for h in r["hooks"]}
    assert {"ruff-check", "ruff-format", "check-added-large-files", "trailing-whitespace", "end-of-file-fixer"} <= set(
        hooks
    )
    assert all(h["language"] == "system" and h["entry"].startswith(".venv/bin/") for h in hooks.values())
