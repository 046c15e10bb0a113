"""Test-only stand-in for the CPU build of ``sgl_kernel`` (SGLang's compiled kernel package).

Why it exists: SGLang 0.5.23's CPU engine (``SGLANG_USE_CPU_ENGINE=1``, ``--device cpu``)
imports a few helpers from ``sgl_kernel`` at module level, and ``sgl_kernel``'s CPU build is
not published on PyPI (its wheels there are CUDA builds that do not import without a GPU).
The end-to-end tests in ``tests/e2e`` put the directory above this package on the
``PYTHONPATH`` of the SGLang server they start, and nowhere else; nothing here is installed
with spec-kernels.

What it implements: exactly the functions SGLang's CPU engine imports unconditionally on the
paths those tests run (EAGLE / EAGLE-3 speculative decoding and plain decoding):

* ``assign_req_to_token_pool_cpu``          (sglang.srt.mem_cache.allocation)
* ``assign_extend_cache_locs_cpu``,
  ``assign_draft_cache_locs_contiguous_cpu`` (sglang.kernels.ops.speculative.cache_locs)
* ``fill_accept_out_cache_loc_cpu``,
  ``fill_bonus_tokens_cpu``                 (sglang.kernels.ops.speculative.eagle)
* ``build_tree_kernel_efficient_cpu``,
  ``verify_tree_greedy_cpu``                (sglang.kernels.ops.speculative.spec_tree)
* ``copy_all_layer_kv_cache_cpu``           (sglang.kernels.ops.kvcache.cache_move)

each with the semantics of SGLang's own GPU version of the same step (its Triton kernel next
to the CPU call site): the index helpers in plain PyTorch, the two tree kernels by running
SGLang's Triton kernels on CPU tensors (the server runs with ``TRITON_INTERPRET=1``).

Every other CPU kernel of sgl_kernel is used by SGLang only when
``torch.ops.sgl_kernel.convert_weight_packed`` exists (its Intel AMX check,
``sglang.srt.utils.cpu_has_amx_support``); this package registers no torch ops, so that check
is false and SGLang takes its PyTorch paths. Any other attribute raises AttributeError, so an
unexpected use fails loudly instead of silently doing nothing.
"""
from __future__ import annotations

import ctypes

import torch

__version__ = "0.0.0+spec-kernels-test-stub"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len):
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the next end[i] - start[i] entries
    of out_cache_loc (requests packed in batch order)."""
    del pool_len  # the row length of req_to_token; PyTorch indexing knows it
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        if n > 0:
            req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += max(n, 0)


def assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                 pool_len):
    """The reverse gather: out_cache_loc, packed in batch order, gets
    req_to_token[req_pool_indices[i], start[i]:end[i]]."""
    del pool_len
    offset = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = end - start
        if n > 0:
            out_cache_loc[offset:offset + n] = req_to_token[row, start:end].to(out_cache_loc.dtype)
        offset += max(n, 0)


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices, req_to_token, seq_lens, out_cache_loc, pool_len,
                                           topk, num_cols):
    """out_cache_loc[i * topk * num_cols : (i + 1) * topk * num_cols] =
    req_to_token[req_pool_indices[i], seq_lens[i] : seq_lens[i] + topk * num_cols]."""
    del pool_len
    width = topk * num_cols
    for i, (row, start) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        out_cache_loc[i * width:(i + 1) * width] = req_to_token[row, start:start + width].to(out_cache_loc.dtype)


def fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, accept_out_cache_loc):
    """Compact the accepted slots: for every accept_index[p] != -1, in order,
    accept_out_cache_loc[k] = out_cache_loc[accept_index[p]] (k counts the accepted ones)."""
    flat = accept_index.reshape(-1)
    src = flat[flat != -1].to(torch.int64)
    accept_out_cache_loc[:src.numel()] = out_cache_loc[src].to(accept_out_cache_loc.dtype)


def fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus_tokens, accept_stride):
    """bonus_tokens[i] = accept_tokens (flat)[accept_stride * i + accept_lens[i] - 1]: the last
    accepted token of request i (accept_lens counts the bonus token)."""
    bs = accept_lens.numel()
    idx = accept_stride * torch.arange(bs, device=accept_lens.device) + accept_lens.to(torch.int64) - 1
    bonus_tokens[:bs] = accept_tokens.reshape(-1)[idx].to(bonus_tokens.dtype)


def build_tree_kernel_efficient_cpu(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                    retrieve_index, retrieve_next_token, retrieve_next_sibling, topk, depth,
                                    draft_token_num, tree_mask_mode):
    """SGLang's Triton tree builder (``sgl_build_tree_kernel_triton``) on CPU tensors."""
    from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton

    sgl_build_tree_kernel_triton(parent_list, selected_index, verified_seq_len, tree_mask, positions,
                                 retrieve_index, retrieve_next_token, retrieve_next_sibling, topk, depth,
                                 draft_token_num, tree_mask_mode)


def verify_tree_greedy_cpu(predicts, accept_index, accept_token_num, candidates, retrive_index,
                           retrive_next_token, retrive_next_sibling, target_predict):
    """SGLang's Triton greedy tree verification (``verify_tree_greedy_triton``) on CPU tensors."""
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton

    verify_tree_greedy_triton(predicts=predicts, accept_index=accept_index, accept_token_num=accept_token_num,
                              candidates=candidates, retrieve_index=retrive_index,
                              retrieve_next_token=retrive_next_token, retrieve_next_sibling=retrive_next_sibling,
                              target_predict=target_predict)


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    """For every KV buffer b (address data_ptrs[b], row size strides[b] bytes): row tgt_loc[i]
    = row src_loc[i]. All source rows are read before any is written, as SGLang's tiled Triton
    kernel does, so overlapping source and target sets move correctly."""
    tgt, src = tgt_loc.tolist(), src_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]
        for t, row in zip(tgt, rows):
            ctypes.memmove(base + t * stride, row, stride)
