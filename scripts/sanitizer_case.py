"""One representative case of every CUDA kernel, for `compute-sanitizer --tool memcheck`
(run by scripts/gpu_check.sh). Exits non-zero when a kernel disagrees with the reference."""

import torch

import spec_kernels
from spec_kernels.testing import make_case


def main() -> None:
    case = make_case([16, 0, 5, 64], [700, 3, 0, 129], hq=16, hkv=4, d=128, dtype=torch.bfloat16,
                     kind="random", seed=0, device="cuda")
    mask = spec_kernels.tree_mask_from_parents(case.parents, case.qo_indptr, impl="cuda")
    assert torch.equal(mask, case.tree_mask), "tree_mask_from_parents (cuda) disagrees"
    ref = spec_kernels.tree_verify_attention(*case.args, impl="reference")
    for splits in (None, 3):
        out = spec_kernels.tree_verify_attention(*case.args, impl="cuda", num_kv_splits=splits)
        torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)
    torch.cuda.synchronize()
    print("sanitizer case: ok")


if __name__ == "__main__":
    main()
