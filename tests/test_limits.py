"""The constants Python and the kernels share are the same numbers on both sides: in the headers
(always) and in the extension that was built (torch.ops.spec_kernels_cuda.compiled_constants)."""
import re
from pathlib import Path

import pytest

from spec_kernels import _limits, _ops
from spec_kernels.comm import ipc
from spec_kernels.kv_slots import reference as kv_ref
from spec_kernels.kv_slots import triton_kernel as kv_triton
from spec_kernels.mla import cuda as mla_cuda
from spec_kernels.norm import MAX_HIDDEN

# C++ name -> the Python value that must equal it.
PYTHON_SIDE = {
    "kMaxDraftTokens": _limits.MAX_DRAFT_TOKENS,
    "kMlaHeadDim": mla_cuda.HEAD_DIM,
    "kMlaVHeadDim": mla_cuda.V_HEAD_DIM,
    "kKvSlotsOk": kv_ref.STATUS_OK,
    "kKvSlotsOutOfPages": kv_ref.STATUS_OUT_OF_PAGES,
    "kKvSlotsBadRequest": kv_ref.STATUS_BAD_REQUEST,
    "kKvSlotsBadStack": kv_ref.STATUS_BAD_STACK,
    "kKvSlotsOutTooSmall": kv_ref.STATUS_OUT_TOO_SMALL,
    "kKvSlotsPageConflict": kv_ref.STATUS_PAGE_CONFLICT,
    "kKvSlotsStatusLen": kv_ref.STATUS_LEN,
    "kPageFree": kv_ref.PAGE_FREE,
    "kPageShared": kv_ref.PAGE_SHARED,
    "kPageMark": kv_ref.PAGE_MARK,
    "kKvMoveSyncWords": kv_triton.MOVE_SYNC_WORDS,
    "kKvMoveTagShift": kv_triton.MOVE_TAG_SHIFT,
    "kKvMoveGenerations": kv_triton.MOVE_GENERATIONS,
    "kKvMoveMaxBlocks": kv_triton.MOVE_MAX_PROGRAMS,
    "kMaxNormHidden": MAX_HIDDEN,
    "kMaxRanks": ipc.MAX_RANKS,
    "kMaxBlocks": ipc.MAX_BLOCKS,
    "kOk": ipc.ERROR_OK,
    "kTimeout": ipc.ERROR_TIMEOUT,
    "kSizeMismatch": ipc.ERROR_SIZE_MISMATCH,
    "kBlocksMismatch": ipc.ERROR_BLOCKS_MISMATCH,
    "kOneShotPush": ipc.ALGORITHM_CODES["oneshot_push"],
    "kOneShotPull": ipc.ALGORITHM_CODES["oneshot_pull"],
    "kTwoShot": ipc.ALGORITHM_CODES["twoshot"],
    "kOneShotPush1Block": ipc.ALGORITHM_CODES["oneshot_push_1block"],
}


def test_the_built_extension_has_the_python_values():
    compiled = _ops.compiled_constants()
    if compiled is None:
        pytest.skip(f"the CUDA extension is not built: {_ops.extension_error()}")
    assert {k: compiled[k] for k in PYTHON_SIDE} == PYTHON_SIDE

INCLUDE = Path(__file__).resolve().parents[1] / "csrc" / "include" / "spec_kernels"


def _cpp_constant(header: str, name: str) -> int:
    found = re.findall(rf"constexpr int {name} = (\d+);", (INCLUDE / header).read_text())
    assert len(found) == 1, f"{header}: {name} defined {len(found)} times"
    return int(found[0])


def test_python_limits_match_the_kernels_headers():
    assert _limits.MAX_DRAFT_TOKENS == _cpp_constant("launchers.h", "kMaxDraftTokens")
    assert (mla_cuda.HEAD_DIM, mla_cuda.V_HEAD_DIM) == (_cpp_constant("mla.h", "kMlaHeadDim"),
                                                        _cpp_constant("mla.h", "kMlaVHeadDim"))
    assert ipc.MAX_BLOCKS == _cpp_constant("norm_allreduce.h", "kMaxBlocks")
    assert ipc.HEADER_ROW_BITS == _cpp_constant("norm_allreduce.h", "kHeaderRowBits")
    assert ipc.MAX_MESSAGE_BYTES == _cpp_constant("norm_allreduce.h", "kMaxMessageBytes")


def test_max_draft_tokens_is_defined_once():
    root = Path(__file__).resolve().parents[1] / "spec_kernels"
    defining = [str(p.relative_to(root)) for p in root.rglob("*.py")
                if re.search(r"^MAX_DRAFT_TOKENS\s*=", p.read_text(), flags=re.M)]
    assert defining == ["_limits.py"]
