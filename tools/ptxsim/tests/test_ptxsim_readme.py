"""The README's example runs as written and computes what it says."""
import os
import re

import numpy as np

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.md")


def test_readme_example_runs(nvcc_ptx):
    with open(README, encoding="utf-8") as f:
        code = re.search(r"```python\n(.*?)```", f.read(), re.S).group(1)
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)
    got = scope["m"].download(scope["y"], np.float32, (100,))
    np.testing.assert_array_equal(got, 1 + 2 * np.arange(100, dtype=np.float32))
    assert scope["stats"].as_dict()["global_bytes_written"] == 400
