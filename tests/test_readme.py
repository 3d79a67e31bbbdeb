import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ci_runs_the_readme_test_command():
    readme = open(os.path.join(ROOT, "README.md")).read()
    ci = open(os.path.join(ROOT, ".ci", "run")).read()
    m = re.search(r"bash \.ci/setup-cpu\.sh && (\.venv/bin/python -m pytest[^\n]*)", readme)
    assert m, "README must give the test command"
    assert m.group(1) in ci.splitlines()
    assert "bash .ci/setup-cpu.sh && .venv/bin/flexflow quickstart" in readme
