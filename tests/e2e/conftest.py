"""Shared set-up of the end-to-end tests: tiny models, transformers' greedy outputs, and
SGLang servers (``python -m sglang.launch_server``) on 127.0.0.1 with ``specfused``.

The servers run SGLang's CPU engine in fp32 with everything the CPU machines lack supplied for
the test only (see `server_env`):

* ``SGLANG_USE_CPU_ENGINE=1`` and ``--device cpu``: SGLang's CPU platform;
* ``TRITON_INTERPRET=1``: spec-kernels' Triton kernels, SGLang's Triton prefill kernels (inside
  specfused) and the draft model's Triton backend run on CPU tensors through the interpreter;
* ``PYTHONPATH`` gets ``sgl_kernel_stub/`` (the few ``sgl_kernel`` CPU helpers SGLang's CPU
  engine imports; see its docstring) and, for the negative control, ``verify_sabotage/``;
* ``HF_HUB_OFFLINE=1``: the models are local directories made by tiny_models.py;
* ``TORCHDYNAMO_DISABLE=1``: SGLang wraps one EAGLE top-k helper in ``torch.compile``, which on
  CPU compiles C++ with the host compiler for tens of seconds; eager mode computes the same.

One server runs at a time (`ServerPool`): a test asks for a configuration by name, the pool
stops the previous server (SIGTERM, then SIGKILL, to its process group) and starts the next;
the module's teardown stops the last one. A failing test gets the tail of its server's log in
its report; the logs stay in pytest's basetemp directory.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import tiny_models  # noqa: E402

MAX_NEW_TOKENS = 32
STARTUP_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 300
SABOTAGE_DIST_INFO = "specfused_e2e_sabotage-0.0.0.dist-info"


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


def write_sabotage_dist_info(directory: str) -> None:
    """The entry point that makes SGLang load verify_sabotage/specfused_e2e_sabotage.py."""
    info = os.path.join(directory, SABOTAGE_DIST_INFO)
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as fh:
        fh.write("Metadata-Version: 2.1\nName: specfused-e2e-sabotage\nVersion: 0.0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as fh:
        fh.write("[sglang.srt.plugins]\nspecfused_e2e_sabotage = specfused_e2e_sabotage:register\n")


def server_env(extra_paths=(), **extra) -> dict:
    env = dict(os.environ)
    paths = [os.path.join(HERE, "sgl_kernel_stub"), *extra_paths]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(SGLANG_USE_CPU_ENGINE="1", TRITON_INTERPRET="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TORCHDYNAMO_DISABLE="1", PYTHONPATH=os.pathsep.join(paths), **extra)
    env.pop("SGLANG_PLUGINS", None)  # load every plugin: specfused (and the sabotage one where given)
    return env


def base_server_args(target: str) -> list[str]:
    return ["--model-path", target, "--device", "cpu", "--dtype", "float32",
            "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
            "--max-total-tokens", "4096", "--skip-server-warmup", "--random-seed", "0",
            # SGLang's Triton prefill/draft kernels: one KV split (the interpreter pays per program)
            "--triton-attention-num-kv-splits", "1"]


# What each server cost, for the terminal summary: name -> (start-up wall s, CPU s of its processes).
TIMINGS: dict[str, tuple[float, float]] = {}


def process_tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its live descendants (and the children they reaped)."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def pytest_terminal_summary(terminalreporter):
    if TIMINGS:
        terminalreporter.write_line("e2e servers (start-up wall s / CPU s of the server's processes): " + ", ".join(
            f"{name} {wall:.0f}/{cpu:.0f}" for name, (wall, cpu) in TIMINGS.items()))


class ServerPool:
    """At most one live server; `get(name)` starts configuration `name` (stopping another)."""

    def __init__(self, configs: dict, log_dir: str):
        self.configs, self.log_dir = configs, log_dir
        self.current = None
        self.startup_s: dict[str, float] = {}

    def get(self, name: str):
        from spec_kernels.serve_check import Server

        if self.current is not None and self.current.name == name and self.current.alive():
            return self.current
        self.stop()
        args, env = self.configs[name]
        server = Server(name, args, os.path.join(self.log_dir, f"{name}.log"), env=env,
                        startup_timeout_s=STARTUP_TIMEOUT_S, grace_s=5.0)
        t0 = time.monotonic()
        self.current = server  # so a failing start still shows its log in the report
        server.start()
        self.startup_s[name] = time.monotonic() - t0
        return server

    def stop(self):
        server = self.current
        if server is not None:
            if server.alive():
                TIMINGS[server.name] = (self.startup_s.get(server.name, float("nan")),
                                        process_tree_cpu_s(server.proc.pid))
            server.stop()


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
