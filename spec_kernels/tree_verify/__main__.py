"""python -m spec_kernels.tree_verify: the KV-split plan of the benchmark shapes on a named GPU
(spec_kernels.tree_verify.launch_plan)."""
from .launch_plan import main

raise SystemExit(main(prog="python -m spec_kernels.tree_verify"))
