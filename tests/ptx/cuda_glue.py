"""The CUDA extension's host side, re-expressed over the PTX interpreter.

`PtxCudaOps` has the methods of torch.ops.spec_kernels_cuda that the Python bindings call
(spec_kernels/*/cuda.py, api.py). Each method does what csrc/ops.cpp and the kernel file's
launch() do (fill the parameter struct from the tensors, size grid / block / dynamic shared
memory the same way) and runs the sm_120a PTX compiled from the checkout's .cu files through
tools/ptxsim, then copies the written buffers back into the CPU tensors. Patching
spec_kernels._ops.cuda_ops to return it runs the real Python binding (launch plan, split buffers)
on top of the compiled kernels.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from tools.ptxsim.build import cuda_ptx
from tools.ptxsim.executor import Launch, Machine
from tools.ptxsim.launch import module_of, pack_params

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARCH = os.environ.get("PTXSIM_ARCH", "sm_120a")

P = ctypes.c_uint64  # device pointers


class TreeVerifyParams(ctypes.Structure):
    """csrc/include/spec_kernels/tree_verify.h (field order and types must match)."""
    _fields_ = [("q", P), ("k_cache", P), ("v_cache", P), ("kv_indptr", P), ("kv_indices", P),
                ("kv_indices_int64", ctypes.c_bool), ("qo_indptr", P), ("tree_mask", P), ("out", P), ("lse", P),
                ("o_partial", P), ("lse_partial", P),
                ("q_stride_t", ctypes.c_int64), ("q_stride_h", ctypes.c_int64),
                ("k_stride_s", ctypes.c_int64), ("k_stride_h", ctypes.c_int64),
                ("v_stride_s", ctypes.c_int64), ("v_stride_h", ctypes.c_int64),
                ("o_stride_t", ctypes.c_int64), ("o_stride_h", ctypes.c_int64),
                ("num_requests", ctypes.c_int), ("num_tokens", ctypes.c_int), ("num_q_heads", ctypes.c_int),
                ("num_kv_heads", ctypes.c_int), ("head_dim", ctypes.c_int),
                ("num_slots", ctypes.c_int64), ("num_indices", ctypes.c_int64),
                ("max_rows", ctypes.c_int), ("num_splits", ctypes.c_int), ("min_chunk", ctypes.c_int),
                ("sm_scale_log2", ctypes.c_float)]


class MlaParams(ctypes.Structure):
    """csrc/include/spec_kernels/mla.h."""
    _fields_ = [("q", P), ("kv_cache", P), ("kv_indptr", P), ("kv_indices", P), ("kv_indices_int64", ctypes.c_bool),
                ("qo_indptr", P), ("tree_mask", P), ("out", P), ("lse", P), ("o_partial", P), ("lse_partial", P),
                ("q_stride_t", ctypes.c_int64), ("q_stride_h", ctypes.c_int64), ("kv_stride_s", ctypes.c_int64),
                ("o_stride_t", ctypes.c_int64), ("o_stride_h", ctypes.c_int64),
                ("num_slots", ctypes.c_int64), ("num_indices", ctypes.c_int64),
                ("num_requests", ctypes.c_int), ("num_tokens", ctypes.c_int), ("num_heads", ctypes.c_int),
                ("max_rows", ctypes.c_int), ("num_splits", ctypes.c_int), ("min_chunk", ctypes.c_int),
                ("sm_scale_log2", ctypes.c_float)]


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


class _Buffers:
    """Tensors uploaded for one call (by storage), copied back after the run when written."""

    def __init__(self, m: Machine):
        self.m = m
        self.by_storage = {}

    def ptr(self, t):
        if t is None:
            return 0
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in self.by_storage:
            raw = torch.empty(0, dtype=torch.uint8).set_(st).numpy() if st.nbytes() else np.zeros(0, np.uint8)
            addr = self.m.upload(raw.copy(), f"tensor{len(self.by_storage)}")
            self.by_storage[key] = (addr, st)
        addr, _ = self.by_storage[key]
        return addr + t.storage_offset() * t.element_size()

    def copy_back(self):
        for addr, st in self.by_storage.values():
            if st.nbytes():
                dst = torch.empty(0, dtype=torch.uint8).set_(st)
                dst.copy_(torch.from_numpy(self.m.download(addr, np.uint8, (st.nbytes(),))))


class PtxCudaOps:
    """torch.ops.spec_kernels_cuda over the interpreter. `launches` records (kernel, grid, block,
    smem, Stats) of every simulated launch for the tests and the counter report."""

    def __init__(self, arch: str = ARCH, mma: str = "fast", check_races: bool = True):
        self.arch = arch
        self.mma = mma
        self.check_races = check_races
        self.launches = []

    def _module(self, cu: str):
        return module_of(cuda_ptx(os.path.join(REPO, "csrc", cu), self.arch))

    def _machine(self):
        return Machine(mma=self.mma, check_races=self.check_races, arch="sm_120" if "120" in self.arch else "sm_90")

    def _run(self, m, mod, entry, grid, block, args, smem=0):
        e = mod.entry(entry)
        stats = m.run(Launch(e, grid, block, pack_params(e, args), smem, name=entry), module=mod)[0]
        self.launches.append((entry, grid, block, smem, stats))
        return stats

    # ------------------------------------------------------------------ tree verify attention
    def tree_verify_attention(self, q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, out, lse,
                              o_partial, lse_partial, sm_scale, num_splits, min_chunk, max_rows):
        T, Hq, D = q.shape
        Hkv = k_cache.shape[1]
        B = kv_indptr.numel() - 1
        if B == 0 or T == 0:
            return
        m = self._machine()
        buf = _Buffers(m)
        p = TreeVerifyParams()
        p.q, p.k_cache, p.v_cache = buf.ptr(q), buf.ptr(k_cache), buf.ptr(v_cache)
        p.kv_indptr, p.kv_indices = buf.ptr(kv_indptr), buf.ptr(kv_indices)
        p.kv_indices_int64 = kv_indices.dtype == torch.int64
        p.qo_indptr, p.tree_mask = buf.ptr(qo_indptr), buf.ptr(tree_mask)
        p.out, p.lse = buf.ptr(out), buf.ptr(lse)
        p.o_partial = buf.ptr(o_partial) if num_splits > 1 else 0
        p.lse_partial = buf.ptr(lse_partial) if num_splits > 1 else 0
        p.q_stride_t, p.q_stride_h = q.stride(0), q.stride(1)
        p.k_stride_s, p.k_stride_h = k_cache.stride(0), k_cache.stride(1)
        p.v_stride_s, p.v_stride_h = v_cache.stride(0), v_cache.stride(1)
        p.o_stride_t, p.o_stride_h = out.stride(0), out.stride(1)
        p.num_requests, p.num_tokens, p.num_q_heads, p.num_kv_heads, p.head_dim = B, T, Hq, Hkv, D
        p.num_slots, p.num_indices = k_cache.shape[0], kv_indices.numel()
        p.max_rows, p.num_splits, p.min_chunk = max_rows, num_splits, min_chunk
        p.sm_scale_log2 = sm_scale * 1.4426950408889634
        raw = bytes(p)
        mod = self._module("tree_verify/tree_verify_attention.cu")
        tname = "13__nv_bfloat16" if q.dtype == torch.bfloat16 else "6__half"
        # launch(): TileConfig<D>::kSmemBytes, 4 warps, 64 rows per CTA
        stage_keys = 32 if D >= 256 else 64
        smem = (64 * D + 4 * stage_keys * D) * 2
        m_blocks = -(-max_rows // 64)
        self._run(m, mod, f"tree_verify_kernelI{tname}Li{D}E", (B * Hkv * m_blocks, num_splits), (128,), [raw], smem)
        if num_splits > 1:
            self._run(m, mod, f"merge_splits_kernelI{tname}E", (T * Hq,), (64,), [raw])
        buf.copy_back()

    # ------------------------------------------------------------------ tree mask
    def tree_mask_from_parents(self, parents, qo_indptr, tree_mask):
        B = qo_indptr.numel() - 1
        if B == 0:
            return
        m = self._machine()
        buf = _Buffers(m)
        mod = self._module("tree_verify/tree_mask.cu")
        self._run(m, mod, "tree_mask_from_parents_kernel", (B,), (64,),
                  [buf.ptr(parents), buf.ptr(qo_indptr), buf.ptr(tree_mask), parents.numel()])
        buf.copy_back()
