"""Helpers of the end-to-end tests, shared by conftest.py and the test modules (a module name of
its own, so that every importer gets the same objects; see conftest.py for what they set up)."""
from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

MAX_NEW_TOKENS = 32
STARTUP_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 300
SABOTAGE_DIST_INFO = "specfused_e2e_sabotage-0.0.0.dist-info"

# What each server cost, for the terminal summary: name -> (start-up wall s, CPU s of its processes).
TIMINGS: dict[str, tuple[float, float]] = {}
# What test_serve_check measured, for the terminal summary: the adaptive config and its rows.
SERVE_CHECK: dict = {}


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
                TIMINGS[server.name] = (self.startup_s.get(server.name, float("nan")), server.cpu_s() or 0.0)
            server.stop()
