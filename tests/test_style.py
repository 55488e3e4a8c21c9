"""One formatter and one linter for the whole repo (pyproject.toml): `ruff format --check` and `ruff check`
pass on every file, and each catches what it is there for: a line packed past 100 columns, an import out of
order, a name that is never defined."""

import shutil
import subprocess
import sys

from helpers import ROOT


def ruff(*argv, cwd=ROOT):
    cmd = [sys.executable, "-m", "ruff", *argv]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=120)


def test_the_repo_is_formatted_and_linted():
    fmt = ruff("format", "--check", ".")
    assert fmt.returncode == 0, fmt.stdout[-3000:] + fmt.stderr[-3000:]
    lint = ruff("check", ".")
    assert lint.returncode == 0, lint.stdout[-3000:] + lint.stderr[-3000:]


def test_the_checks_catch_a_packed_line(tmp_path):
    """dp.py with one call packed back onto a line past 100 columns fails `ruff format --check`; a message
    past the prose limit, imports out of order and an undefined name fail `ruff check`, under the repo's own
    pyproject.toml."""
    for name in (
        "pyproject.toml",
        "dp.py",
        "common.py",
        "harness.py",
    ):  # its first-party imports too
        shutil.copy(ROOT / name, tmp_path)
    assert ruff("format", "--check", "dp.py", cwd=tmp_path).returncode == 0
    packed = (
        "x = dict(alpha=1, beta=2, gamma=3, delta=4, epsilon=5, zeta=6, eta=7, theta=8, iota=9)"
    )
    packed += " or dict(kappa=10)\n"
    assert len(packed) > 101
    (tmp_path / "dp.py").write_text((ROOT / "dp.py").read_text() + packed)
    assert ruff("format", "--check", "dp.py", cwd=tmp_path).returncode == 1
    (tmp_path / "dp.py").write_text((ROOT / "dp.py").read_text())
    assert ruff("check", "dp.py", cwd=tmp_path).returncode == 0
    for bad in (f'x = "{"word " * 30}"\n', "import torch\nimport os\n", "y = undefined_name\n"):
        (tmp_path / "bad.py").write_text(bad)
        assert ruff("check", "bad.py", cwd=tmp_path).returncode == 1, bad
