"""The CUDA extension's host side, re-expressed over the PTX interpreter.

`PtxCudaOps` has the methods of torch.ops.spec_kernels_cuda that the Python bindings call
(spec_kernels/*/cuda.py, api.py). Each method does what the binding (csrc/<family>/*_binding.cpp) and the kernel file's
launch() do (fill the parameter struct from the tensors, size grid / block / dynamic shared
memory the same way; a merge kernel launched as a programmatic dependent runs together with the
kernel before it) and runs the sm_120a PTX compiled from the checkout's .cu files through
tools/ptxsim, then copies the written buffers back into the CPU tensors. Patching
spec_kernels._ops.cuda_ops to return it runs the real Python binding (launch plan, split buffers)
on top of the compiled kernels.
"""
from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from tools.ptx_harness.build import cuda_ptx, cuda_ptx_from_source
from ptxsim.executor import Launch, Machine
from ptxsim.launch import module_of, pack_params

from spec_kernels import _ops
from spec_kernels.attention.checks import KV_FP8_DTYPES
from spec_kernels.attention.triton_common import LOG2E
from tools.ptx_harness.shipped import device_max_smem, device_smem, entry_of, header_struct, short_name, source_constant

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARCH = os.environ.get("PTXSIM_ARCH", "sm_120a")

P = ctypes.c_uint64  # device pointers


# The parameter structs, laid out from the headers (tests/ptx/test_shipped.py checks their sizes
# against the built extension's sizeof).
TreeVerifyParams = header_struct("TreeVerifyParams")
MlaParams = header_struct("MlaParams")
IndexTensor = header_struct("IndexTensor")
KvSlotBatch = header_struct("KvSlotBatch")
KvCommitArgs = header_struct("KvCommitArgs")
_DTYPE_NAMES = {torch.float16: "__half", torch.bfloat16: "__nv_bfloat16", torch.float32: "float"}


def _np(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


# What an output element holds before the launch (poison), per dtype: NaN for the float types,
# 0x7f (NaN) for fp8 e4m3, so an element the kernel should write but does not cannot match a
# reference value, 0 included.
_POISON = {torch.float32: float("nan"), torch.float16: float("nan"), torch.bfloat16: float("nan"),
           torch.float8_e4m3fn: float("nan")}


class _Buffers:
    """Tensors uploaded for one call (by storage), copied back after the run when written."""

    def __init__(self, m: Machine):
        self.m = m
        self.by_storage = {}

    def ptr(self, t, name=None, poison=False):
        """The simulated address of t. poison: t is an output the launch must write in full; its
        elements start as _POISON in the simulated memory (not the caller's values), unless its
        storage is also an input of the call (in-place use) and was uploaded as such."""
        if t is None:
            return 0
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in self.by_storage:
            raw = torch.empty(0, dtype=torch.uint8).set_(st).clone() if st.nbytes() else torch.zeros(0, dtype=torch.uint8)
            if poison and t.numel():
                torch.empty(0, dtype=t.dtype).set_(raw.untyped_storage(), t.storage_offset(), t.shape,
                                                   t.stride()).fill_(_POISON[t.dtype])
            addr = self.m.upload(raw.numpy(), name or f"tensor{len(self.by_storage)}")
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

    def __init__(self, arch: str = ARCH, mma: str = "fast", check_races: bool = True, patched=None, latencies=None):
        """patched: {csrc-relative .cu path: edited source text} compiled instead of the file
        (the mutant tests); a header key (a csrc-relative .cuh / .h, csrc/include's too) is used instead of the
        file by every .cu this object compiles."""
        self.arch = arch
        self.mma = mma
        self.check_races = check_races
        self.patched = dict(patched or {})
        self.latencies = latencies  # per instruction class: keeps ptxsim's per-warp latency clock
        self.launches = []

    def _module(self, cu: str):
        headers = {k: v for k, v in self.patched.items() if not k.endswith(".cu")}
        if cu in self.patched or headers:
            text = self.patched.get(cu)
            if text is None:
                with open(os.path.join(REPO, "csrc", cu), encoding="utf-8") as f:
                    text = f.read()
            return module_of(cuda_ptx_from_source(text, self.arch, os.path.join("csrc", cu), headers=headers))
        return module_of(cuda_ptx(os.path.join(REPO, "csrc", cu), self.arch))

    def _machine(self):
        return Machine(mma=self.mma, check_races=self.check_races, arch="sm_120" if "120" in self.arch else "sm_90",
                       latencies=self.latencies, max_smem=device_max_smem(self.arch))

    def _run(self, m, mod, entry, grid, block, args, smem=0, dependent=None):
        """Run one launch; dependent: (entry, grid, block, args) of a kernel launched as its
        programmatic dependent (programmatic_launch.cuh's launch_dependent), run together with it:
        the dependent starts first and its griddepcontrol.wait holds until this launch exits."""
        specs = [(entry, grid, block, args, smem)] + ([(*dependent, 0)] if dependent else [])
        launches = []
        for i, (name, g, b, a, sm) in enumerate(specs):
            e = mod.entry(name)
            launches.append(Launch(e, g, b, pack_params(e, a), sm, name=name, after=(0,) if i else ()))
        all_stats = m.run(*launches, module=mod)
        for (name, g, b, _, sm), stats in zip(specs, all_stats):
            self.launches.append((short_name(name) if name.startswith("_Z") else name, g, b, sm, stats))
        return all_stats[0]

    # ------------------------------------------------------------------ tree verify attention
    def tree_verify_attention(self, q, k_cache, v_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, out, lse,
                              o_partial, lse_partial, sm_scale, num_splits, min_chunk, max_rows, k_scale=1.0,
                              v_scale=1.0, k_scale_tensor=None, v_scale_tensor=None):
        T, Hq, D = q.shape
        Hkv = k_cache.shape[1]
        B = kv_indptr.numel() - 1
        if B == 0 or T == 0:
            return
        m = self._machine()
        buf = _Buffers(m)
        p = TreeVerifyParams()
        p.q, p.k_cache, p.v_cache = buf.ptr(q, "q"), buf.ptr(k_cache, "k_cache"), buf.ptr(v_cache, "v_cache")
        p.kv_indptr, p.kv_indices = buf.ptr(kv_indptr, "kv_indptr"), buf.ptr(kv_indices, "kv_indices")
        p.kv_indices_int64 = kv_indices.dtype == torch.int64
        p.qo_indptr, p.tree_mask = buf.ptr(qo_indptr, "qo_indptr"), buf.ptr(tree_mask, "tree_mask")
        p.out, p.lse = buf.ptr(out, "out", poison=True), buf.ptr(lse, "lse", poison=True)
        p.o_partial = buf.ptr(o_partial, "o_partial", poison=True) if num_splits > 1 else 0
        p.lse_partial = buf.ptr(lse_partial, "lse_partial", poison=True) if num_splits > 1 else 0
        p.q_stride_t, p.q_stride_h = q.stride(0), q.stride(1)
        p.k_stride_s, p.k_stride_h = k_cache.stride(0), k_cache.stride(1)
        p.v_stride_s, p.v_stride_h = v_cache.stride(0), v_cache.stride(1)
        p.o_stride_t, p.o_stride_h = out.stride(0), out.stride(1)
        p.num_requests, p.num_tokens, p.num_q_heads, p.num_kv_heads, p.head_dim = B, T, Hq, Hkv, D
        p.num_slots, p.num_indices = k_cache.shape[0], kv_indices.numel()
        p.max_rows, p.num_splits, p.min_chunk = max_rows, num_splits, min_chunk
        p.sm_scale_log2 = sm_scale * LOG2E
        fp8 = k_cache.dtype in KV_FP8_DTYPES
        p.kv_format = _kv_format(k_cache.dtype)
        p.k_scale, p.v_scale = k_scale, v_scale
        p.k_scale_ptr, p.v_scale_ptr = buf.ptr(k_scale_tensor, "k_scale"), buf.ptr(v_scale_tensor, "v_scale")
        raw = bytes(p)
        mod = self._module("tree_verify/tree_verify_attention.cu")
        tname = _DTYPE_NAMES[q.dtype]
        # launch(): the configuration tree_verify_launch_shape picks for max_rows on the GPU the
        # arch stands for (the extension's own host code), its grid of (request, KV head, row
        # block) x splits
        shape = _ops.tree_verify_launch_config(D, max_rows, *device_smem(self.arch), fp8)
        m_blocks = -(-max_rows // shape.block_m)
        merge = (entry_of(mod, "merge_splits_kernel", tname), (T * Hq,),
                 (_ops.compiled_constants()["kTreeVerifyMergeThreads"],), [raw])
        self._run(m, mod, entry_of(mod, "tree_verify_kernel", tname, shape.template_args),
                  (B * Hkv * m_blocks, num_splits), (shape.threads,), [raw], shape.smem_bytes,
                  dependent=merge if num_splits > 1 else None)
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

    # ------------------------------------------------------------------ MLA tree verify attention
    def mla_tree_verify_attention(self, q, kv_cache, kv_indptr, kv_indices, qo_indptr, tree_mask, out, lse,
                                  o_partial, lse_partial, sm_scale, num_splits, min_chunk, max_rows, k_scale=1.0,
                                  v_scale=1.0, k_scale_tensor=None, v_scale_tensor=None):
        T, H, D = q.shape
        B = kv_indptr.numel() - 1
        # launch_mla_tree_verify_attention(): nothing to do without requests or tokens
        if B == 0 or T == 0:
            return
        m = self._machine()
        buf = _Buffers(m)
        p = MlaParams()
        p.q, p.kv_cache = buf.ptr(q, "q"), buf.ptr(kv_cache, "kv_cache")
        p.kv_indptr, p.kv_indices = buf.ptr(kv_indptr), buf.ptr(kv_indices)
        p.kv_indices_int64 = kv_indices.dtype == torch.int64
        p.qo_indptr = buf.ptr(qo_indptr) if qo_indptr is not None else 0
        p.tree_mask = buf.ptr(tree_mask) if tree_mask is not None else 0
        p.out = buf.ptr(out, "out", poison=True)
        p.lse = buf.ptr(lse, "lse", poison=True) if lse is not None else 0
        p.o_partial = buf.ptr(o_partial, "o_partial", poison=True) if num_splits > 1 else 0
        p.lse_partial = buf.ptr(lse_partial, "lse_partial", poison=True) if num_splits > 1 else 0
        p.q_stride_t, p.q_stride_h = q.stride(0), q.stride(1)
        p.kv_stride_s = kv_cache.stride(0)
        p.o_stride_t, p.o_stride_h = out.stride(0), out.stride(1)
        p.num_slots, p.num_indices = kv_cache.shape[0], kv_indices.numel()
        p.num_requests, p.num_tokens, p.num_heads = B, T, H
        p.max_rows, p.num_splits, p.min_chunk = max_rows, num_splits, min_chunk
        p.sm_scale_log2 = sm_scale * LOG2E
        fp8 = kv_cache.dtype in KV_FP8_DTYPES
        p.kv_format = _kv_format(kv_cache.dtype)
        p.k_scale, p.v_scale = k_scale, v_scale
        p.k_scale_ptr, p.v_scale_ptr = buf.ptr(k_scale_tensor, "k_scale"), buf.ptr(v_scale_tensor, "v_scale")
        raw = bytes(p)
        mod = self._module("mla/mla_tree_verify_attention.cu")
        tname = _DTYPE_NAMES[q.dtype]
        # launch_for_rows(): the configuration mla_launch_shape picks for max_rows on the arch's GPU, its grid of
        # (request, row block) x splits
        shape = _ops.mla_launch_config(max_rows, *device_smem(self.arch), fp8)
        m_blocks = -(-max_rows // shape.block_m)
        merge = (entry_of(mod, "mla_merge_splits_kernel", tname), (T * H,),
                 (_ops.compiled_constants()["kMlaMergeThreads"],), [raw])
        self._run(m, mod, entry_of(mod, "mla_tree_verify_kernel", tname, shape.template_args),
                  (B * m_blocks, num_splits), (shape.threads,), [raw], shape.smem_bytes,
                  dependent=merge if num_splits > 1 else None)
        buf.copy_back()

    # ------------------------------------------------------------------ fused add + RMSNorm
    def fused_add_rmsnorm(self, x, residual, weight, out, residual_out, eps, out_scale):
        rows, hidden = x.shape
        if rows == 0:  # launch_fused_add_rmsnorm(): no launch
            return
        fp8 = out_scale is not None
        # norm_checks.h inv_out_scale(): 1 / out_scale in fp32, 1 without fp8 output (launch_out passes 1.f)
        inv_scale = float(np.float32(1.0 / out_scale)) if fp8 else 1.0
        m = self._machine()
        buf = _Buffers(m)
        px, pr, pw = (buf.ptr(t) for t in (x, residual, weight))
        po, pro = buf.ptr(out, "out", poison=True), buf.ptr(residual_out, "residual_out", poison=True)
        tname = _DTYPE_NAMES[x.dtype]
        oname = "__nv_fp8_e4m3" if fp8 else tname
        # launch_typed(): 16-byte vectors when hidden % kVec == 0 and the (simulated) device
        # pointers are 16-byte aligned (out: kVec * sizeof(OutT) bytes), else the scalar kernel
        vec = 16 // x.element_size()
        out_vec_bytes = vec * out.element_size()
        vec_ok = (hidden % vec == 0 and all(a % 16 == 0 for a in (px, pr, pw, pro)) and po % out_vec_bytes == 0)
        if not vec_ok:
            vec = 1
        # launch_vec(): norm::row_launch(hidden / VEC, kMaxItems)
        max_items = 16 if vec == 1 else 4
        nvec = hidden // vec
        items = 1
        while items < max_items and nvec > items * 1024:
            items *= 2
        threads = -(-nvec // items)
        threads = min(-(-threads // 32) * 32, 1024)
        mod = self._module("norm/fused_add_rmsnorm.cu")
        self._run(m, mod, entry_of(mod, "fused_add_rmsnorm_kernel", tname, oname, vec, items), (rows,), (threads,),
                  [px, pr, pw, po, pro, hidden, float(eps), inv_scale])
        buf.copy_back()

    # ------------------------------------------------------------------ draft-token KV slots
    def alloc_draft_slots(self, req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free,
                          page_state, page_size, max_draft, out_cache_loc, status):
        m = self._machine()
        buf = _Buffers(m)
        batch = _kv_slot_batch(buf, req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free,
                               page_state, page_size, max_draft, status)
        mod = self._module("kv_slots/kv_slots.cu")
        # launch_alloc_draft_slots: one block of kThreads
        self._run(m, mod, "alloc_draft_slots_kernel", (1,), (KV_THREADS,),
                  [bytes(batch), buf.ptr(out_cache_loc), out_cache_loc.numel(), _group_size_for(max_draft)])
        buf.copy_back()

    def commit_draft_slots(self, req_to_token, req_pool_indices, seq_lens, num_draft, accept_index, accept_len,
                           free_pages, num_free, page_state, page_size, max_draft, kv_table, kv_rows, kv_unit_bytes,
                           kv_blocks_per_request, move_sync, new_seq_lens, status):
        m = self._machine()
        buf = _Buffers(m)
        batch = _kv_slot_batch(buf, req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free,
                               page_state, page_size, max_draft, status)
        B = req_pool_indices.numel()
        args = KvCommitArgs()
        args.accept_index = IndexTensor(buf.ptr(accept_index), accept_index.dtype == torch.int64)
        args.accept_width = accept_index.shape[1]
        args.accept_len = IndexTensor(buf.ptr(accept_len), accept_len.dtype == torch.int64)
        args.new_seq_lens = IndexTensor(buf.ptr(new_seq_lens), new_seq_lens.dtype == torch.int64)
        kv = None
        if kv_table is not None:
            # The table holds the buffers' addresses in this process: their bytes go to the
            # simulated memory and the table is rewritten with the simulated addresses.
            kv = _KvRegions(m, kv_table, kv_rows)
            args.kv_table = kv.table_addr
            args.num_kv_buffers = kv_table.shape[1]
            args.num_kv_rows = kv_rows
            args.kv_unit_bytes = kv_unit_bytes
            args.kv_blocks_per_request = kv_blocks_per_request
        if kv_table is not None and page_size > 1 and B > 0:
            if move_sync is None or move_sync.numel() != KV_MOVE_SYNC_WORDS or move_sync.dtype != torch.int64:
                raise ValueError(f"move_sync must be an int64 [{KV_MOVE_SYNC_WORDS}] when KV rows move")
            args.move_sync = buf.ptr(move_sync)
        # launch_commit_draft_slots
        moves = page_size > 1 and kv_table is not None and B > 0
        pool_slots = free_pages.numel() * page_size
        slot_bound = kv_rows if moves and kv_rows < pool_slots else pool_slots
        prefix_only = page_size > 1 and not moves
        if not moves:
            args.move_sync = 0
        blocks = B * kv_blocks_per_request if moves else 1
        mod = self._module("kv_slots/kv_slots.cu")
        self._run(m, mod, "commit_draft_slots_kernel", (blocks,), (KV_THREADS,),
                  [bytes(batch), bytes(args), _group_size_for(max_draft), slot_bound, int(prefix_only)])
        buf.copy_back()
        if kv is not None:
            kv.copy_back()


KV_THREADS = source_constant("kKvSlotsThreads")
KV_MOVE_SYNC_WORDS = source_constant("kKvMoveSyncWords")


def _group_size_for(max_draft):
    g = 1
    while g < max_draft and g < 32:
        g *= 2
    return g


def _kv_slot_batch(buf, req_to_token, req_pool_indices, seq_lens, num_draft, free_pages, num_free, page_state,
                   page_size, max_draft, status):
    """kv_slots_binding.cpp kv_slot_batch (its argument checks are the binding's business here)."""
    for name, t in (("req_to_token", req_to_token), ("req_pool_indices", req_pool_indices),
                    ("seq_lens", seq_lens), ("num_draft", num_draft)):
        if t.dtype not in (torch.int32, torch.int64) or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32/int64 tensor")
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"page_size must be a power of two, got {page_size}")
    b = KvSlotBatch()
    b.req_to_token = IndexTensor(buf.ptr(req_to_token), req_to_token.dtype == torch.int64)
    b.num_rows, b.max_context = req_to_token.shape
    b.req_pool_indices = IndexTensor(buf.ptr(req_pool_indices), req_pool_indices.dtype == torch.int64)
    b.seq_lens = IndexTensor(buf.ptr(seq_lens), seq_lens.dtype == torch.int64)
    b.num_draft = IndexTensor(buf.ptr(num_draft), num_draft.dtype == torch.int64)
    b.num_requests = req_pool_indices.numel()
    b.free_pages = buf.ptr(free_pages)
    b.num_pages = free_pages.numel()
    b.num_free = buf.ptr(num_free)
    b.page_state = buf.ptr(page_state)
    b.log2_page_size = page_size.bit_length() - 1
    b.max_draft = max_draft
    b.status = buf.ptr(status)
    return b


class _KvRegions:
    """The KV buffers a commit's kv_table points at (int64 [3, n]: address in this process, row
    stride bytes, row bytes): their bytes copied into the simulated memory (buffers whose spans
    overlap, e.g. K and V as interleaved views of one tensor, share one region), the table
    rewritten with the simulated addresses, and the bytes copied back after the run."""

    def __init__(self, m: Machine, kv_table, kv_rows):
        self.m = m
        rows = kv_table.cpu().tolist()
        spans = [(base, base + (kv_rows - 1) * stride + row_bytes) for base, stride, row_bytes in zip(*rows)]
        merged = []
        for lo, hi in sorted(spans):
            if merged and lo < merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], hi)
            else:
                merged.append([lo, hi])
        self.regions = []
        for lo, hi in merged:
            data = np.frombuffer(ctypes.string_at(lo, hi - lo), np.uint8).copy()
            self.regions.append((lo, hi, m.upload(data, f"kv{len(self.regions)}")))
        sim = [next(addr + base - lo for lo, hi, addr in self.regions if lo <= base < hi) for base, _ in spans]
        table = np.array([sim, rows[1], rows[2]], dtype=np.int64)
        self.table_addr = m.upload(table, "kv_table")

    def copy_back(self):
        for lo, hi, addr in self.regions:
            data = self.m.download(addr, np.uint8, (hi - lo,))
            ctypes.memmove(lo, data.ctypes.data, hi - lo)


def _kv_format(cache_dtype) -> int:
    """The params' kv_format of a cache dtype (kKvLikeQ / kKvE4M3 / kKvE5M2 in tree_verify.h)."""
    return source_constant({torch.float8_e4m3fn: "kKvE4M3", torch.float8_e5m2: "kKvE5M2"}.get(cache_dtype, "kKvLikeQ"))


def run_tree_verify(case, ops, *, decode=False, splits=0, max_draft_tokens=0, scales=None, out_offset=0,
                    sm_scale=None):
    """A spec_kernels.testing.Case through the real tree-verify binding (spec_kernels.tree_verify.cuda)
    with its cuda_ops pointing at `ops` (a PtxCudaOps); (out, lse), NaN where nothing was written.
    scales: the KvScales of an fp8 cache; out_offset: `out` starts this many elements into its
    buffer (an odd offset: rows that are not 8-byte aligned); sm_scale: D ** -0.5 when None."""
    from spec_kernels.attention.checks import NO_SCALES
    from spec_kernels.tree_verify import cuda as tv_cuda

    T, Hq, D = case.q.shape
    if decode:
        T = case.kv_indptr.numel() - 1
    q = case.q[:T]
    dv = case.v_cache.shape[2]
    out = torch.full((out_offset + T * Hq * dv,), float("nan"), dtype=q.dtype)[out_offset:].view(T, Hq, dv)
    lse = torch.full((T, Hq), float("nan"))
    saved = tv_cuda.cuda_ops
    tv_cuda.cuda_ops = lambda: ops
    try:
        tv_cuda.tree_verify_attention(q, case.k_cache, case.v_cache, case.kv_indptr, case.kv_indices,
                                      None if decode else case.qo_indptr, None if decode else case.tree_mask,
                                      D ** -0.5 if sm_scale is None else sm_scale, out, lse, num_kv_splits=splits, max_draft_tokens=max_draft_tokens,
                                      scales=scales or NO_SCALES)
    finally:
        tv_cuda.cuda_ops = saved
    return out, lse
