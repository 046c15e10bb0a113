"""Reads of registers not written on every active thread, on hand-written PTX: lane-wise
instructions carry the undefinedness to their destination, and the instruction that uses such a
value (a store, a guard, an address) is the error. The first kernel is the cross-warp reduction
Triton 3.6 emits for tl.max over 8 warps: the partials are loaded by the first 8 lanes only, all 32
lanes shuffle and combine them, and only lane 0's result is stored."""
import numpy as np
import pytest

from ptxsim.executor import Machine
from ptxsim.launch import run
from ptxsim.memory import SimError

_PTX = r"""
.version 9.0
.target sm_120a
.address_size 64

.visible .entry partial_max(
	.param .u64 .ptr .align 1 partial_max_param_0,
	.param .u64 .ptr .align 1 partial_max_param_1,
	.param .u32 partial_max_param_2
)
{
	.reg .pred 	%p<6>;
	.reg .b32 	%r<12>;
	.reg .b64 	%rd<6>;
	.loc	1 10 0
	ld.param.u64 	%rd1, [partial_max_param_0];
	ld.param.u64 	%rd2, [partial_max_param_1];
	ld.param.u32 	%r10, [partial_max_param_2];
	mov.u32 	%r1, %tid.x;
	setp.lt.u32 	%p1, %r1, 8;
	setp.lt.u32 	%p2, %r1, %r10;
	mul.wide.u32 	%rd3, %r1, 4;
	add.s64 	%rd4, %rd1, %rd3;
	.loc	1 11 0
	@%p1 ld.global.b32 	%r2, [%rd4];
	.loc	1 12 0
	shfl.sync.bfly.b32 	%r3, %r2, 4, 31, -1;
	max.s32 	%r4, %r2, %r3;
	shfl.sync.bfly.b32 	%r5, %r4, 2, 31, -1;
	max.s32 	%r6, %r4, %r5;
	shfl.sync.bfly.b32 	%r7, %r6, 1, 31, -1;
	max.s32 	%r8, %r6, %r7;
	.loc	1 13 0
	add.s64 	%rd5, %rd2, %rd3;
	@%p2 st.global.b32 	[%rd5], %r8;
	ret;
}

.visible .entry branch_on_undefined(
	.param .u64 .ptr .align 1 branch_on_undefined_param_0
)
{
	.reg .pred 	%p<4>;
	.reg .b32 	%r<6>;
	.reg .b64 	%rd<4>;
	.loc	1 20 0
	ld.param.u64 	%rd1, [branch_on_undefined_param_0];
	mov.u32 	%r1, %tid.x;
	setp.lt.u32 	%p1, %r1, 8;
	.loc	1 21 0
	@%p1 ld.global.b32 	%r2, [%rd1];
	.loc	1 22 0
	add.s32 	%r3, %r2, 1;
	setp.eq.s32 	%p2, %r3, 0;
	.loc	1 23 0
	@%p2 bra 	$L__done;
	st.global.b32 	[%rd1], %r1;
$L__done:
	ret;
}
"""


def _partial_max(lanes_storing):
    m = Machine()
    x = np.array([3, -7, 41, 5, 0, 12, -2, 9] + [1000] * 56, np.int32)  # lanes 8.. are never loaded
    a, out = m.upload(x), m.upload(np.full(64, -1, np.int32))
    run(m, _PTX, "partial_max", (1,), (64,), [a, out, lanes_storing])
    return m.download(out, np.int32, (64,))


def test_values_computed_on_lanes_that_never_use_them_are_no_error():
    got = _partial_max(lanes_storing=1)
    assert got[0] == 41 and (got[1:] == -1).all()
    got = _partial_max(lanes_storing=8)  # each of the first 8 lanes combines the 8 loaded partials
    assert (got[:8] == 41).all() and (got[8:] == -1).all()


def test_storing_a_value_computed_from_an_unwritten_register_is_an_error():
    with pytest.raises(SimError, match=r"read of register %r8 that is not written on every active thread "
                                       r"\(its value on those threads comes from %r2, read at file1:12"):
        _partial_max(lanes_storing=9)


def test_branching_on_a_value_computed_from_an_unwritten_register_is_an_error():
    m = Machine()
    a = m.upload(np.zeros(1, np.int32))
    with pytest.raises(SimError, match=r"read of register %p2 that is not written on every active thread "
                                       r"\(its value on those threads comes from %r2, read at file1:22"):
        run(m, _PTX, "branch_on_undefined", (1,), (32,), [a])
