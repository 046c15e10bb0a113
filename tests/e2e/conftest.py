"""Shared set-up of the end-to-end tests: tiny models, transformers' greedy outputs, and
SGLang servers (``python -m sglang.launch_server``) on 127.0.0.1 with ``specfused``.

The servers run SGLang's CPU engine in fp32 with everything the CPU machines lack supplied for
the test only (see `e2e_support.server_env`):

* ``SGLANG_USE_CPU_ENGINE=1`` and ``--device cpu``: SGLang's CPU platform;
* ``TRITON_INTERPRET=1``: spec-kernels' Triton kernels, SGLang's Triton prefill kernels (inside
  specfused) and the draft model's Triton backend run on CPU tensors through the interpreter;
* ``PYTHONPATH`` gets ``sgl_kernel_stub/`` (the few ``sgl_kernel`` CPU helpers SGLang's CPU
  engine imports; see its docstring) and, for the negative control, ``verify_sabotage/``;
* ``HF_HUB_OFFLINE=1``: the models are local directories made by tiny_models.py;
* ``TORCHDYNAMO_DISABLE=1``: SGLang wraps one EAGLE top-k helper in ``torch.compile``, which on
  CPU compiles C++ with the host compiler for tens of seconds; eager mode computes the same.

One server runs at a time (`e2e_support.ServerPool`): a test asks for a configuration by name, the pool
stops the previous server (SIGTERM, then SIGKILL, to its process group) and starts the next;
the module's teardown stops the last one. A failing test gets the tail of its server's log in
its report; the logs stay in pytest's basetemp directory.
"""
from __future__ import annotations

import importlib.util

import pytest

import tiny_models
from e2e_support import MAX_NEW_TOKENS, SERVE_CHECK, TIMINGS, ServerPool


def pytest_collection_modifyitems(config, items):
    if importlib.util.find_spec("sglang") is not None:
        return
    skip = pytest.mark.skip(reason="SGLang is not installed (pip install --no-deps -r requirements/sglang-cpu.txt)")
    for item in items:
        if "e2e" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Tokenizer, target and draft directories, the prompts' token ids, and transformers'
    greedy continuations of them (MAX_NEW_TOKENS each)."""
    root = str(tmp_path_factory.mktemp("e2e_models"))
    made = tiny_models.make_models(root)
    made["hf_greedy"] = tiny_models.hf_greedy(made["target"], made["prompt_ids"], MAX_NEW_TOKENS)
    return made


@pytest.fixture(scope="session")
def mla_models(tmp_path_factory):
    """The same for the DeepSeek-V2 style MLA target (latent 128 + rope 32) and its draft."""
    root = str(tmp_path_factory.mktemp("e2e_mla_models"))
    made = tiny_models.make_models(root, mla=True)
    made["hf_greedy"] = tiny_models.hf_greedy(made["target"], made["prompt_ids"], MAX_NEW_TOKENS)
    return made


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.write_line("e2e servers (start-up wall s / CPU s of the server's processes): " + ", ".join(
            f"{name} {wall:.0f}/{cpu:.0f}" for name, (wall, cpu) in TIMINGS.items()))
    if SERVE_CHECK:
        terminalreporter.write_line(f"serve_check (tok/s, CPU): adaptive config {SERVE_CHECK['config']}; " + "; ".join(
            f"C={r['concurrency']}: adaptive {r['adaptive_tok_s']:.1f} (predicted {r['predicted_tok_s']:.1f}), "
            f"adaptive / max(baseline, EAGLE) {r['adaptive_over_best_static']:.2f}, "
            f"drafting off / baseline {r.get('eagle_off_over_baseline', float('nan')):.2f}" for r in SERVE_CHECK["rows"]))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.when == "teardown" or not report.failed:
        return
    pool = item.funcargs.get("servers") if hasattr(item, "funcargs") else None
    if isinstance(pool, ServerPool) and pool.current is not None:
        report.sections.append((f"server log ({pool.current.name}, tail of {pool.current.log_path})",
                                pool.current.log_tail(80)))
