"""The kernels need torch and triton only: plots and progress bars are the `[bench]` extra, and a
tool that lacks one says which extra to install."""
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from spec_kernels._extras import MissingExtraError, import_extra

ROOT = Path(__file__).resolve().parents[1]


def test_runtime_dependencies_are_torch_and_triton():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("<")[0].split("=")[0].strip() for d in project["dependencies"]}
    assert names == {"torch", "triton"}
    assert {"matplotlib", "tqdm"} <= set(project["optional-dependencies"]["bench"])


def test_the_package_and_its_clis_import_without_the_extras():
    # None in sys.modules makes `import matplotlib` / `import tqdm` raise ImportError, as if absent.
    code = ("import sys; sys.modules.update(matplotlib=None, tqdm=None); "
            "import spec_kernels, spec_kernels.comm.tune, spec_kernels.policy.__main__; "
            "from spec_kernels.policy.__main__ import write_plot; "
            "write_plot('/nonexistent.png', None, [], 1, '')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 1 and "MissingExtraError: the policy's plot needs matplotlib" in out.stderr, out.stderr


def test_a_missing_extra_is_named():
    with pytest.raises(MissingExtraError, match=r"the plot needs no_such_module_x, .*pip install 'spec-kernels\[bench\]'"):
        import_extra("no_such_module_x.pyplot", "bench", "the plot")
    assert import_extra("json", "bench", "x").dumps([]) == "[]"


def test_tune_without_tqdm_stops_before_starting_ranks():
    code = ("import sys; sys.modules['tqdm'] = None; from spec_kernels.comm import tune; "
            "sys.exit(tune.main(['--device', 'cpu']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "pip install 'spec-kernels[bench]'" in out.stderr, out.stderr
    assert "tuning" not in out.stdout
