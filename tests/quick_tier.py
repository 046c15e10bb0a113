"""Which tests `pytest -m quick` runs: the edit-test loop, every op family in a few minutes.

Outside tests/ptx every test is quick except those listed in NOT_QUICK (servers, compiles of every
configuration, several processes, long random sequences) and the e2e-marked ones. Inside tests/ptx
(each case runs compiled PTX in the interpreter) only PTX_QUICK is: one case per CUDA kernel and
configuration family (the interpreter's own tests, tools/ptxsim/tests, are quick). An entry names a file, a test function
(all its parameters) or one parametrized case; tests/test_tiers.py fails on an entry that
matches nothing, so a renamed test cannot drop out of the tier unnoticed.
"""
NOT_QUICK = (
    "tests/test_decode_step_smoke.py",          # the benchmark run as a subprocess
    "tests/test_kv_slots_invariants.py",        # hypothesis over long operation sequences
    "tests/test_triton_compile.py",             # compiles every Triton kernel for two archs
    "tests/test_kv_slots.py::test_triton_kernels_compile_for_sm90",
    "tests/test_sass_report.py::test_report_on_the_tree_verify_kernel",  # nvcc to cubins
    "tests/test_sass_report.py::test_report_on_the_mla_kernel_meets_its_targets",
    "tests/test_sass_report.py::test_configuration_lists_state_the_compiled_resources",  # two archs
    "tests/test_sglang_hooks.py::test_fused_allreduce_hook_on_two_tp_ranks",
    "tests/test_sglang_backend.py::test_server_arg_resolution_with_eagle3",
    "tests/test_sglang_backend.py::test_launch_server_help_lists_specfused",
    "tests/test_sglang_mla.py::test_server_arg_resolution_accepts_specfused_for_deepseek_v3",
    "tests/test_comm.py::test_cpu_matches_reference[4]",  # [2] stays: the fallback on two ranks
    "tests/test_comm.py::test_cpu_timeout_raises_instead_of_hanging",
    "tests/test_comm.py::test_cpu_size_mismatch_fails_loudly_on_every_rank",
    "tests/test_comm.py::test_cpu_reset_recovers_after_a_refused_call",
    "tests/test_allreduce_emulator.py::test_orderings_the_model_finds_unneeded_pass_every_case",  # every case, 3x
    "tests/test_comm.py::test_tune_cli_writes_a_table_the_communicator_uses",
    "tests/test_comm.py::test_topo_cli_without_gpus",
    "tests/test_p2p_check.py::test_cpu_four_ranks_pass_then_one_rank_fails_setup",
    "tests/test_p2p_check.py::test_communicator_hook_names_the_failing_pair_on_every_rank",
    "tests/test_cli.py::test_info_help_is_a_usage_text",
    "tests/test_bench_compare.py::test_cli_exit_status",
    "tests/test_extras.py::test_tune_without_tqdm_stops_before_starting_ranks",
    "tests/test_tiers.py",                      # collects the whole suite three times
)

# Each CUDA kernel source (csrc/<family>/<name>.cu) and the PTX test file that runs it.
CUDA_KERNEL_TESTS = {
    "csrc/tree_verify/tree_verify_attention.cu": "tests/ptx/test_tree_verify_ptx.py",
    "csrc/tree_verify/tree_mask.cu": "tests/ptx/test_tree_mask_ptx.py",
    "csrc/mla/mla_tree_verify_attention.cu": "tests/ptx/test_mla_ptx.py",
    "csrc/kv_slots/kv_slots.cu": "tests/ptx/test_kv_slots_ptx.py",
    "csrc/norm/fused_add_rmsnorm.cu": "tests/ptx/test_norm_ptx.py",
    "csrc/allreduce/fused_allreduce.cu": "tests/ptx/test_allreduce_ptx.py",
}

PTX_QUICK = (
    "tests/ptx/test_tree_mask_ptx.py",
    "tests/ptx/test_norm_ptx.py::test_matches_reference",
    "tests/ptx/test_tree_verify_ptx.py::test_tree_verify_matches_reference[case0]",
    "tests/ptx/test_tree_verify_ptx.py::test_tree_verify_matches_reference[case6]",
    "tests/ptx/test_tree_verify_ptx.py::test_decode_matches_reference[dtype1-2-64]",
    "tests/ptx/test_tree_verify_ptx.py::test_sm90a_ptx_matches_reference",
    "tests/ptx/test_tree_verify_fp8_ptx.py::test_fp8_cache_matches_reference[case0]",
    "tests/ptx/test_mla_fp8_ptx.py::test_fp8_tree_verify_matches_reference[bf16-e4m3-bm16-split3]",
    "tests/ptx/test_mla_ptx.py::test_tree_verify_matches_reference[f16-tree-64-drafts]",
    "tests/ptx/test_mla_ptx.py::test_decode_matches_reference[f16-decode-h5-split1]",
    "tests/ptx/test_kv_slots_ptx.py::test_steps_match_reference[16-1-rtt_dtype1-index_dtype1]",
    "tests/ptx/test_kv_slots_ptx.py::test_kernel_refusals_change_nothing[1]",
    "tests/ptx/test_allreduce_ptx.py::test_consecutive_calls_match_reference[oneshot_push-2-fp16]",
    "tests/ptx/test_allreduce_ptx.py::test_consecutive_calls_match_reference[oneshot_push_1block-2-bf16]",
    "tests/ptx/test_allreduce_ptx.py::test_consecutive_calls_match_reference[oneshot_pull-2-bf16]",
    "tests/ptx/test_allreduce_ptx.py::test_consecutive_calls_match_reference[twoshot-2-fp16]",
    "tests/ptx/test_triton_ptx.py::test_tree_verify_split_kv_and_merge[fp16]",
    "tests/ptx/test_triton_ptx.py::test_fused_add_rmsnorm[fp16-4096]",
)


def matches(entry: str, nodeid: str) -> bool:
    """`entry` names this test: the same id, its file, or its function (any parameters)."""
    return nodeid == entry or nodeid.startswith(entry + "::") or ("[" not in entry and nodeid.startswith(entry + "["))


def is_quick(nodeid: str, keywords) -> bool:
    if "e2e" in keywords or "gpu" in keywords:  # gpu tests: scripts/gpu_check.sh
        return False
    if nodeid.startswith("tests/ptx/"):
        return any(matches(e, nodeid) for e in PTX_QUICK)
    return not any(matches(e, nodeid) for e in NOT_QUICK)
