"""The README as a user reads it: its Python examples run as written, and `.ci/run` runs exactly
its set-up and test commands."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, flags=re.M | re.S)


PYTHON_BLOCKS = _blocks("python")


def test_readme_has_examples():
    assert len(PYTHON_BLOCKS) >= 4


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_example_runs_as_written(index):
    exec(compile(PYTHON_BLOCKS[index], f"README.md python block {index}", "exec"), {"__name__": "__readme__"})


def test_ci_runs_the_readme_commands():
    setup_block = next(b for b in _blocks("bash") if "pip install" in b and "pytest" in b)
    commands = [line.split("#", 1)[0].strip() for line in setup_block.splitlines()]
    commands = [c for c in commands if c]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert commands == [c for c in ci if c in commands], f"README commands {commands} not run in order by .ci/run"
    assert set(commands) <= set(ci)
