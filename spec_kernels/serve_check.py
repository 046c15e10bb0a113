"""python -m spec_kernels.serve_check --model TARGET --draft EAGLE3_DRAFT [options] [-- SERVER ARGS]

Plain decoding, static EAGLE-3 and SGLang's adaptive speculation configured from those two, at the
same concurrencies, in one command. It launches SGLang on this machine, one server after the other:

1. ``baseline``: the target model without speculation (``--baseline-attention-backend``, default
   SGLang's own choice);
2. ``eagle``: EAGLE-3 with ``--attention-backend specfused`` (``--steps``, ``--topk``,
   ``--draft-tokens``);
3. the policy (``spec_kernels.policy``) on what the servers before it measured, whole-step costs and acceptance:
   SGLang's ``--speculative-adaptive-config`` (written to ``STEM.adaptive_config.json`` next to
   ``--out``) and its predicted output tok/s at every concurrency;
4. ``adaptive``: server 2 with ``--speculative-adaptive --speculative-adaptive-config`` from 3
   (SGLang's adaptive mode runs chains only: ``--topk 1``; ``--no-adaptive`` skips 3 and 4).

With ``--measure-off`` a server ``eagle_off`` runs before 3: the adaptive server with drafting
turned off at every batch size (candidate steps 0; SGLang still runs its EAGLE worker, a 1-token
verify and the draft's extend), compared with 1: what speculation costs once the adaptive tier
has switched it off. The policy then judges the steps-0 tier by that cost instead of the plain
server's, and says per concurrency whether the adaptive or a plain server is faster.
``--skip-off-draft-extend`` runs the adaptive servers with SGLang's
``SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1`` (no draft extend while drafting is off: cheaper
steps, a cold draft when drafting resumes).

On each it runs the same greedy check (temperature 0, EOS ignored: the first prompt alone, then
all check prompts in one batch), a warm-up (``--warmup`` requests, not timed), and a closed-loop
load test at every concurrency C of ``--concurrency``: C clients each send their next request as
soon as the previous one returns, ``--rounds`` x C requests in all. It then reports, per
concurrency, output tok/s, request latency (mean, median, p90) and, for EAGLE-3, the acceptance
length tau (output tokens / verify steps, bonus token included, as SGLang's ``spec_accept_length``);
for the adaptive server also the steps the policy chose, its prediction and the prediction error
(predicted / measured - 1), and adaptive / max(baseline, EAGLE). It fails (exit status 1) when a
greedy output of any server differs from the baseline's.

The JSON it writes (``--out``) is at once a cost file and an acceptance file for the throughput
model, so ``python -m spec_kernels.policy --costs OUT --acceptance OUT`` reads it:

* ``steps``: whole-step costs derived from the closed loop (concurrency = batch size B):
  baseline ``step_s = B / tok_s`` (each step emits B tokens), EAGLE-3
  ``step_s = B x tau(B) / tok_s`` (each step emits B x tau tokens), as in
  ``spec_kernels/policy/examples/design_table_costs.json``;
* ``configs``: the EAGLE-3 configuration (n = draft tokens, its topk) with the tau measured over
  all levels;
* ``adaptive``: the config the policy wrote, its predictions and their errors per concurrency;
* plus what was measured: the servers' command lines, the greedy check, every level's numbers.
A plot (``STEM.png``: output tok/s vs concurrency for baseline, EAGLE static, adaptive and the
policy's prediction) is written when matplotlib (the ``bench`` extra) is installed.

Requests are SGLang's native ``/generate`` with text prompts (``--prompts``: a JSON list of
strings or a text file with one prompt per line; a small built-in English set otherwise) and a
fixed number of output tokens (``ignore_eos``). The client is this module's own (threads and
http.client, no extra packages), because acceptance is read per request from ``/generate``'s
``meta_info`` and token counts must be exact; ``python -m sglang.bench_serving`` (which needs
the ``datasets`` package) can be pointed at the same servers for other workloads.

Everything after ``--`` goes to every server (e.g. ``-- --tp 8 --dtype bfloat16``);
``--baseline-args`` / ``--eagle-args`` add arguments to one of them (``--eagle-args`` also to the
adaptive servers, which are the EAGLE-3 server plus the adaptive flags). The servers bind
``--host`` (default 127.0.0.1) and are always stopped, also on errors and Ctrl-C; their logs
are written next to ``--out``.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import http.client
import json
import os
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

DEFAULT_CONCURRENCY = (1, 2, 5, 10, 30, 70, 100, 250)
DEFAULT_PROMPTS = (
    "Explain how a hash table handles collisions.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List five tips for writing clear technical documentation.",
    "What is the difference between a process and a thread?",
    "Summarize the causes of the French Revolution in a few sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Describe the water cycle to a ten-year-old.",
    "Give a recipe for a simple tomato soup.",
)


class ServerError(RuntimeError):
    """A server that did not start, died, or answered with an error (carries its log's tail)."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Server:
    """``python -m sglang.launch_server ARGS --host HOST --port PORT`` as a context manager.

    Started in its own process group (SGLang forks a scheduler and a detokenizer), so
    `stop` ends all of it: SIGTERM to the group, then SIGKILL after `grace_s`. `start` waits
    until ``/health`` answers 200, and raises ServerError with the log's tail if the process
    exits first or `startup_timeout_s` passes."""

    def __init__(self, name: str, args: Sequence[str], log_path: str, host: str = "127.0.0.1",
                 port: Optional[int] = None, env: Optional[dict] = None, startup_timeout_s: float = 900.0,
                 grace_s: float = 20.0):
        self.name, self.args, self.log_path, self.host = name, list(args), log_path, host
        self.port = port or free_port(host)
        self.env, self.startup_timeout_s, self.grace_s = env, startup_timeout_s, grace_s
        self.proc: Optional[subprocess.Popen] = None
        self.startup_s: Optional[float] = None

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "sglang.launch_server", *self.args, "--host", self.host,
                "--port", str(self.port)]

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "Server":
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        log = open(self.log_path, "w")
        t0 = time.monotonic()
        try:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        try:
            while True:
                if self.proc.poll() is not None:
                    raise ServerError(f"{self.name} server exited with status {self.proc.returncode} while "
                                      f"starting; log {self.log_path}:\n{self.log_tail()}")
                if time.monotonic() - t0 > self.startup_timeout_s:
                    raise ServerError(f"{self.name} server not ready after {self.startup_timeout_s:.0f} s; "
                                      f"log {self.log_path}:\n{self.log_tail()}")
                try:
                    status, _ = _http(self.host, self.port, "GET", "/health", None, timeout=5)
                    if status == 200:
                        break
                except OSError:
                    pass
                time.sleep(1.0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """SIGTERM to the server's process group; SIGKILL what is left after `grace_s`."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the server leads its own group
        for sig, wait_s in ((signal.SIGTERM, self.grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and (proc.poll() is None or _group_alive(pgid)):
                time.sleep(0.2)
            if proc.poll() is not None and not _group_alive(pgid):
                return

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def cpu_s(self) -> Optional[float]:
        """CPU seconds (user + system) the server's processes used so far; None without psutil."""
        if not self.alive():
            return None
        try:
            import psutil
        except ImportError:
            return None
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return None
        total = 0.0
        for proc in procs:
            try:
                t = proc.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
            except psutil.NoSuchProcess:
                pass
        return total

    def log_tail(self, lines: int = 60) -> str:
        try:
            with open(self.log_path, errors="replace") as fh:
                return "".join(fh.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def post(self, path: str, payload: Optional[dict] = None, timeout: float = 600.0) -> bytes:
        """POST `payload` as JSON to `path`; the response body (ServerError unless status 200)."""
        status, body = _http(self.host, self.port, "POST", path, payload, timeout=timeout)
        if status != 200:
            raise ServerError(f"{self.name}: {path} answered {status}: {body[:500]!r}")
        return body

    def generate(self, payload: dict, timeout: float = 600.0):
        """POST /generate; returns the decoded JSON (a dict, or a list for batched input)."""
        return json.loads(self.post("/generate", payload, timeout))

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _http(host: str, port: int, method: str, path: str, payload, timeout: float) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        body = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def greedy_params(max_new_tokens: int) -> dict:
    return {"temperature": 0.0, "max_new_tokens": int(max_new_tokens), "ignore_eos": True}


# ------------------------------------------------------------------------------------ measuring
@dataclass
class Level:
    """One closed-loop run at a fixed concurrency."""

    concurrency: int
    requests: int
    wall_s: float
    output_tokens: int
    latencies_s: list = field(repr=False)
    verify_steps: int = 0  # EAGLE: sum of spec_verify_ct (0: no speculation info)

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def tau(self) -> Optional[float]:
        return self.output_tokens / self.verify_steps if self.verify_steps else None

    def as_dict(self) -> dict:
        lat = sorted(self.latencies_s)
        return {
            "concurrency": self.concurrency, "requests": self.requests, "wall_s": self.wall_s,
            "output_tokens": self.output_tokens, "output_tok_s": self.tok_s,
            "latency_mean_s": statistics.fmean(lat), "latency_median_s": statistics.median(lat),
            "latency_p90_s": lat[min(len(lat) - 1, int(0.9 * len(lat)))],
            "verify_steps": self.verify_steps, "tau": self.tau,
        }


def run_level(server: Server, prompts: Sequence[str], concurrency: int, num_requests: int, output_len: int,
              timeout: float) -> Level:
    """`concurrency` clients, each sending its next request when its previous one returns."""
    lock = threading.Lock()
    next_index = [0]
    latencies, tokens, steps = [], [0], [0]
    errors: list[BaseException] = []

    def client():
        while True:
            with lock:
                if errors or next_index[0] >= num_requests:
                    return
                i = next_index[0]
                next_index[0] += 1
            payload = {"text": prompts[i % len(prompts)], "sampling_params": greedy_params(output_len)}
            t0 = time.perf_counter()
            try:
                out = server.generate(payload, timeout=timeout)
            except BaseException as exc:  # reported once all clients stopped
                with lock:
                    errors.append(exc)
                return
            dt = time.perf_counter() - t0
            meta = out.get("meta_info", {})
            with lock:
                latencies.append(dt)
                tokens[0] += int(meta.get("completion_tokens", 0))
                steps[0] += int(meta.get("spec_verify_ct", 0) or 0)

    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(max_workers=concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    wall = time.perf_counter() - t0
    if errors:
        raise ServerError(f"{server.name}: a request failed at concurrency {concurrency}: {errors[0]}")
    return Level(concurrency, num_requests, wall, tokens[0], latencies, steps[0])


def greedy_check(server: Server, prompts: Sequence[str], output_len: int, timeout: float) -> dict:
    """The first prompt alone (batch 1), then all prompts in one /generate call (batch N):
    their output ids and the acceptance length over both."""
    params = greedy_params(output_len)
    alone = server.generate({"text": prompts[0], "sampling_params": params}, timeout=timeout)
    outs = server.generate({"text": list(prompts), "sampling_params": params}, timeout=timeout)
    tokens = sum(int(o["meta_info"].get("completion_tokens", 0)) for o in [alone, *outs])
    steps = sum(int(o["meta_info"].get("spec_verify_ct", 0) or 0) for o in [alone, *outs])
    return {"batch1_output_ids": alone["output_ids"], "output_ids": [o["output_ids"] for o in outs],
            "tau": tokens / steps if steps else None}


def compare_outputs(base: list, eagle: list) -> list[dict]:
    """Per prompt: equal, and the index of the first differing token (None when equal)."""
    rows = []
    for a, b in zip(base, eagle):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))
        rows.append({"equal": first is None, "first_difference": first})
    return rows


def cost_rows(levels: dict[str, list[Level]], n: int) -> list[dict]:
    """Whole-step costs for spec_kernels.policy (closed loop: B = concurrency); ``eagle_off``
    rows where that server was measured."""
    rows = []
    for lv in levels["baseline"]:
        rows.append({"mode": "baseline", "B": lv.concurrency, "n": 1,
                     "step_s": lv.concurrency / lv.tok_s, "tok_s": lv.tok_s})
    for lv in levels["eagle"]:
        tau = lv.tau or 1.0
        rows.append({"mode": "eagle", "B": lv.concurrency, "n": n, "step_s": lv.concurrency * tau / lv.tok_s,
                     "tok_s": lv.tok_s, "tau_measured": tau})
    for lv in levels.get("eagle_off", []):  # drafting off: one token per request per step
        rows.append({"mode": "eagle_off", "B": lv.concurrency, "n": 1, "step_s": lv.concurrency / lv.tok_s,
                     "tok_s": lv.tok_s})
    return rows


# ------------------------------------------------------------------------------------ CLI
def _ints(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want positive integers, e.g. 1,2,5,10")
    return values


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want a positive integer")
    return value


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: want a non-negative integer")
    return value


def load_prompts(path: Optional[str]) -> list[str]:
    if path is None:
        return list(DEFAULT_PROMPTS)
    with open(path) as fh:
        text = fh.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = [line for line in text.splitlines() if line.strip()]
    if not isinstance(data, list) or not data or not all(isinstance(p, str) and p for p in data):
        raise ValueError(f"{path}: want a JSON list of non-empty strings or one prompt per line")
    return data


def parse_args(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    shared: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, shared = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="python -m spec_kernels.serve_check", description="\n\n".join(__doc__.split("\n\n")[1:3]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="target model (path or hub id)")
    p.add_argument("--draft", required=True, help="EAGLE-3 draft model (path or hub id)")
    p.add_argument("--steps", type=_positive_int, default=3, help="--speculative-num-steps (default 3)")
    p.add_argument("--topk", type=_positive_int, default=1, help="--speculative-eagle-topk (default 1: a chain)")
    p.add_argument("--draft-tokens", type=_positive_int,
                   help="--speculative-num-draft-tokens (default: steps + 1 for a chain, else 16)")
    p.add_argument("--baseline-attention-backend", help="the baseline's --attention-backend (default: SGLang's)")
    p.add_argument("--concurrency", type=_ints, default=list(DEFAULT_CONCURRENCY),
                   help="closed-loop concurrencies (default 1,2,5,10,30,70,100,250)")
    p.add_argument("--rounds", type=_positive_int, default=4,
                   help="requests per level = rounds x concurrency (default 4)")
    p.add_argument("--warmup", type=_count,
                   help="untimed requests before the levels, at the largest concurrency (default: that "
                        "concurrency, one round; 0: none)")
    p.add_argument("--output-len", type=_positive_int, default=512, help="output tokens per load-test request (default 512)")
    p.add_argument("--check-len", type=_positive_int, default=64, help="output tokens per greedy-check prompt")
    p.add_argument("--prompts", help="JSON list of prompts, or a text file with one prompt per line")
    p.add_argument("--no-adaptive", action="store_true",
                   help="measure baseline and EAGLE-3 only (no policy-configured adaptive server)")
    p.add_argument("--measure-off", action="store_true",
                   help="also measure the adaptive server with drafting off at every batch size (steps 0); "
                        "the policy then uses that cost for its no-drafting tier")
    p.add_argument("--skip-off-draft-extend", action="store_true",
                   help="adaptive servers skip the draft's extend while drafting is off "
                        "(SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND=1)")
    p.add_argument("--host", default="127.0.0.1", help="address the servers bind (default 127.0.0.1)")
    p.add_argument("--out", default="serve_check.json", help="result JSON (server logs go next to it)")
    p.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for each server")
    p.add_argument("--request-timeout", type=float, default=1800.0, help="seconds per request")
    p.add_argument("--baseline-args", default="", help="extra arguments for the baseline server only")
    p.add_argument("--eagle-args", default="", help="extra arguments for the EAGLE-3 servers (static and adaptive)")
    args = p.parse_args(argv)
    args.shared = shared
    if args.draft_tokens is None:
        args.draft_tokens = args.steps + 1 if args.topk == 1 else 16
    if args.topk == 1 and args.draft_tokens > args.steps + 1:
        p.error(f"a chain (--topk 1) verifies at most steps + 1 = {args.steps + 1} tokens, got --draft-tokens "
                f"{args.draft_tokens}")
    if args.draft_tokens < 2:
        p.error("--draft-tokens must be at least 2")
    if args.topk != 1 and not args.no_adaptive:
        p.error(f"SGLang's adaptive speculation runs chains only (--topk 1), got --topk {args.topk}; "
                "pass --no-adaptive to measure a tree against the baseline alone")
    if args.topk == 1 and not args.no_adaptive and args.draft_tokens != args.steps + 1:
        p.error(f"adaptive speculation runs steps + 1 draft tokens per chain; --draft-tokens {args.draft_tokens} "
                f"with --steps {args.steps} needs --no-adaptive")
    if (args.measure_off or args.skip_off_draft_extend) and args.no_adaptive:
        p.error("--measure-off and --skip-off-draft-extend concern adaptive servers; they cannot go with --no-adaptive")
    if args.warmup is None:
        args.warmup = max(args.concurrency)
    return args


def _eagle_common(args) -> list[str]:
    return ["--model-path", args.model, *args.shared, "--attention-backend", "specfused",
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", args.draft,
            "--speculative-eagle-topk", str(args.topk)]


def server_args(args) -> dict[str, list[str]]:
    """The command lines of the baseline and the static EAGLE-3 server."""
    baseline = ["--model-path", args.model, *args.shared] + (
        ["--attention-backend", args.baseline_attention_backend] if args.baseline_attention_backend else []
    ) + shlex.split(args.baseline_args)
    eagle = _eagle_common(args) + ["--speculative-num-steps", str(args.steps),
                                   "--speculative-num-draft-tokens", str(args.draft_tokens)] + shlex.split(args.eagle_args)
    return {"baseline": baseline, "eagle": eagle}


def adaptive_server_args(args, config_path: str, initial_steps: int) -> list[str]:
    """The EAGLE-3 server under SGLang's adaptive speculation with `config_path`; it starts at
    `initial_steps` (one of the config's candidate steps; 0 = drafting off, 1 draft token)."""
    return _eagle_common(args) + ["--speculative-num-steps", str(initial_steps),
                                  "--speculative-num-draft-tokens", str(initial_steps + 1),
                                  "--speculative-adaptive", "--speculative-adaptive-config", config_path
                                  ] + shlex.split(args.eagle_args)


# Drafting off at every batch size: the price of SGLang's EAGLE worker once adaptive has turned
# speculation off.
OFF_CONFIG = {"1": {"candidate_steps": [0]}}


def adaptive_env(args) -> Optional[dict]:
    """The adaptive servers' environment: this one, plus SGLang's skip switch when asked."""
    if not args.skip_off_draft_extend:
        return None
    return dict(os.environ, SGLANG_SPEC_SKIP_ZERO_STEP_DRAFT_EXTEND="1")


def measure(name: str, cmd_args: list[str], args, prompts: list[str], log_path: str, report,
            env: Optional[dict] = None) -> dict:
    with Server(name, cmd_args, log_path, host=args.host, startup_timeout_s=args.startup_timeout, env=env) as srv:
        report(f"{name}: up after {srv.startup_s:.1f} s ({srv.base_url}, log {log_path})")
        check = greedy_check(srv, prompts, args.check_len, args.request_timeout)
        if args.warmup:
            run_level(srv, prompts, min(args.warmup, max(args.concurrency)), args.warmup, args.output_len,
                      args.request_timeout)
        levels = []
        for c in args.concurrency:
            lv = run_level(srv, prompts, c, args.rounds * c, args.output_len, args.request_timeout)
            levels.append(lv)
            tau = f", tau {lv.tau:.2f}" if lv.tau else ""
            report(f"{name}: C={c}: {lv.tok_s:.1f} tok/s, median latency {statistics.median(lv.latencies_s):.2f} s{tau}")
        return {"command": srv.command, "startup_s": srv.startup_s, "cpu_s": srv.cpu_s(), "check": check,
                "levels": levels}


def greedy_rows(base: dict, other: dict) -> dict:
    """`other`'s greedy check against the baseline's: per prompt, batch 1, all equal."""
    rows = compare_outputs(base["output_ids"], other["output_ids"])
    batch1 = compare_outputs([base["batch1_output_ids"]], [other["batch1_output_ids"]])[0]
    return {"per_prompt": rows, "batch1": batch1, "all_equal": batch1["equal"] and all(r["equal"] for r in rows)}


def adaptive_rows(levels: dict[str, list[Level]], predictions: dict) -> list[dict]:
    """Per concurrency: the policy's steps and prediction for the adaptive server, its measurement,
    the prediction error (predicted / measured - 1), adaptive / max(baseline, EAGLE), the faster
    server the policy predicted; with an ``eagle_off`` run, its tok/s and eagle_off / baseline."""
    rows = []
    off = {lv.concurrency: lv for lv in levels.get("eagle_off", [])}
    for b, e, a in zip(levels["baseline"], levels["eagle"], levels["adaptive"]):
        c = b.concurrency
        pred = predictions[c]
        best_static = max(b.tok_s, e.tok_s)
        row = dict(concurrency=c, **pred, adaptive_tok_s=a.tok_s,
                   prediction_error=pred["predicted_tok_s"] / a.tok_s - 1.0, best_static_tok_s=best_static,
                   adaptive_over_best_static=a.tok_s / best_static, adaptive_verify_steps=a.verify_steps)
        if c in off:
            row.update(eagle_off_tok_s=off[c].tok_s, eagle_off_over_baseline=off[c].tok_s / b.tok_s)
        rows.append(row)
    return rows


def policy_config(out_path: str, max_B: int, concurrency: Sequence[int]) -> tuple[dict, dict]:
    """The policy on the measured cost/acceptance file: SGLang's adaptive config over B = 1..max_B,
    and per concurrency the steps the adaptive server runs (0: drafting off), its predicted tok/s
    and which server (adaptive or plain) the policy predicts faster."""
    from .policy.model import load_acceptance, load_costs, predict_adaptive, sglang_adaptive_config

    costs = load_costs(out_path)
    configs, _ = load_acceptance(out_path)
    config = sglang_adaptive_config(costs, configs, max_B)
    steps_of = {c.name: c.sglang_steps for c in configs}
    predictions = {}
    for c in concurrency:
        p = predict_adaptive(costs, configs, c)
        predictions[c] = {"policy_steps": 0 if p.best == "off" else steps_of[p.best],
                          "predicted_tok_s": p.best_tok_s, "predicted_plain_tok_s": p.plain,
                          "faster_server": "adaptive" if p.best_tok_s > p.plain else "plain"}
    return config, predictions


def write_plot(path: str, levels: dict[str, list[Level]], predictions: Optional[dict], title: str) -> None:
    """Output tok/s vs concurrency of every server measured and, given `predictions`
    (concurrency -> tok/s), the policy's prediction for the adaptive server."""
    from .policy.plot import save_throughput_figure, throughput_figure

    plt, fig, ax = throughput_figure("serve_check's plot")
    styles = {"baseline": ("black", "o", "baseline"), "eagle": ("tab:blue", "s", "EAGLE-3 static"),
              "adaptive": ("tab:green", "^", "adaptive (policy's config)"),
              "eagle_off": ("tab:red", "v", "EAGLE worker, drafting off")}
    for name, lvs in levels.items():
        color, marker, label = styles[name]
        ax.plot([lv.concurrency for lv in lvs], [lv.tok_s for lv in lvs], color=color, marker=marker, lw=1.5,
                label=label)
    if predictions:
        cs = sorted(predictions)
        ax.plot(cs, [predictions[c] for c in cs], color="0.6", ls="--", lw=2,
                label="policy's prediction (adaptive)")
    save_throughput_figure(plt, fig, ax, path, "concurrency (closed loop)", title)


def format_table(levels: dict[str, list[Level]], adaptive: Optional[list[dict]]) -> list[str]:
    head = f"{'C':>5} | {'base tok/s':>10} | {'base p50 s':>10} | {'EAGLE tok/s':>11} | {'tau':>5} | {'EAGLE/base':>10}"
    if adaptive:
        head += (f" | {'steps':>5} | {'predicted':>9} | {'adaptive':>8} | {'pred err':>8} | {'adapt/best':>10}")
        if "eagle_off_tok_s" in adaptive[0]:
            head += f" | {'off tok/s':>9} | {'off/base':>8}"
        head += " | faster (predicted)"
    lines = [head]
    for i, (b, e) in enumerate(zip(levels["baseline"], levels["eagle"])):
        line = (f"{b.concurrency:>5} | {b.tok_s:>10.1f} | {statistics.median(b.latencies_s):>10.2f} | "
                f"{e.tok_s:>11.1f} | {e.tau or 0:>5.2f} | {e.tok_s / b.tok_s:>10.2f}")
        if adaptive:
            r = adaptive[i]
            line += (f" | {r['policy_steps']:>5} | {r['predicted_tok_s']:>9.1f} | {r['adaptive_tok_s']:>8.1f} | "
                     f"{r['prediction_error']:>+8.1%} | {r['adaptive_over_best_static']:>10.2f}")
            if "eagle_off_tok_s" in r:
                line += f" | {r['eagle_off_tok_s']:>9.1f} | {r['eagle_off_over_baseline']:>8.2f}"
            line += f" | {r['faster_server']}"
        lines.append(line)
    return lines


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as fh:
        json.dump(data, fh, indent=2)
        fh.write("\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        prompts = load_prompts(args.prompts)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out_dir = os.path.dirname(os.path.abspath(args.out))
    stem = os.path.splitext(os.path.basename(args.out))[0]
    os.makedirs(out_dir, exist_ok=True)

    def report(line):
        print(line, flush=True)

    def log_path(name):
        return os.path.join(out_dir, f"{stem}.{name}.log")

    cmds = server_args(args)
    runs = {}
    try:
        for name in ("baseline", "eagle"):
            runs[name] = measure(name, cmds[name], args, prompts, log_path(name), report)
        if args.measure_off:  # before the policy, which judges the steps-0 tier by it
            off_path = os.path.join(out_dir, f"{stem}.off_config.json")
            _write_json(off_path, OFF_CONFIG)
            runs["eagle_off"] = measure("eagle_off", adaptive_server_args(args, off_path, 0), args, prompts,
                                        log_path("eagle_off"), report, adaptive_env(args))
    except ServerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    levels = {k: v["levels"] for k, v in runs.items()}
    eagle_tokens = sum(lv.output_tokens for lv in levels["eagle"])
    eagle_steps = sum(lv.verify_steps for lv in levels["eagle"])
    tau = eagle_tokens / eagle_steps if eagle_steps else 1.0
    label = f"eagle3-{'chain' if args.topk == 1 else 'tree'}-{args.draft_tokens}"
    n = args.draft_tokens
    result = {
        "description": f"serve_check: {args.model} + EAGLE-3 {args.draft} (steps {args.steps}, topk {args.topk}, "
                       f"{n} draft tokens) on specfused vs baseline, closed loop",
        "source": "spec_kernels.serve_check: whole-step costs derived from measured output tok/s "
                  "(baseline step_s = B / tok_s, EAGLE step_s = B x tau / tok_s, B = concurrency)",
        "steps": cost_rows(levels, n),
        "configs": [{"n": n, "tau": min(max(tau, 1.0), n), "topk": args.topk, "label": label}],
        "settings": {"concurrency": args.concurrency, "rounds": args.rounds, "output_len": args.output_len,
                     "warmup": args.warmup},
    }
    _write_json(args.out, result)  # the policy reads the costs and the acceptance from this file

    predictions = adaptive = None
    if not args.no_adaptive:
        config, predictions = policy_config(args.out, max(args.concurrency), args.concurrency)
        config_path = os.path.join(out_dir, f"{stem}.adaptive_config.json")
        _write_json(config_path, config)
        report(f"policy: --speculative-adaptive-config {config_path}: {json.dumps(config)}")
        try:
            runs["adaptive"] = measure("adaptive", adaptive_server_args(args, config_path,
                                                                        config["1"]["candidate_steps"][0]),
                                       args, prompts, log_path("adaptive"), report, adaptive_env(args))
        except ServerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        levels = {k: v["levels"] for k, v in runs.items()}
        adaptive = adaptive_rows(levels, predictions)
        result["adaptive"] = {
            "config_path": config_path, "config": config, "skip_off_draft_extend": args.skip_off_draft_extend,
            "per_concurrency": adaptive,
            "predicted_tok_s_is": "the policy's tok/s for the adaptive server: the faster of its chain and its "
                                  "drafting-off tier (at the eagle_off cost when measured, else the baseline's); "
                                  "prediction_error = predicted / measured - 1"}

    base_check = runs["baseline"]["check"]
    greedy = {name: greedy_rows(base_check, run["check"]) for name, run in runs.items() if name != "baseline"}
    result["greedy_check"] = {
        "prompts": prompts, "max_new_tokens": args.check_len,
        "all_equal": all(g["all_equal"] for g in greedy.values()),
        "per_server": greedy,
        "output_ids": {name: run["check"]["output_ids"] for name, run in runs.items()},
        "batch1_output_ids": {name: run["check"]["batch1_output_ids"] for name, run in runs.items()},
        "tau": {name: run["check"]["tau"] for name, run in runs.items()},
    }
    result["servers"] = {k: {"command": v["command"], "startup_s": v["startup_s"], "cpu_s": v["cpu_s"]}
                         for k, v in runs.items()}
    result["levels"] = {k: [lv.as_dict() for lv in v] for k, v in levels.items()}
    _write_json(args.out, result)

    print()
    print("\n".join(format_table(levels, adaptive)))
    if adaptive:
        print("steps: the policy's choice for the adaptive server (0 = drafting off); predicted: its tok/s there; "
              "pred err = predicted / adaptive - 1; adapt/best = adaptive / max(baseline, EAGLE)"
              + ("; off: the EAGLE worker with drafting off (steps 0)" if args.measure_off else "")
              + "; faster: the adaptive or a plain server, as the policy predicts")
    print()
    for name, g in greedy.items():
        rows, batch1 = g["per_prompt"], g["batch1"]
        equal = sum(r["equal"] for r in rows)
        print(f"greedy check of {name} vs baseline over {args.check_len} tokens: batch {len(rows)}: "
              f"{equal}/{len(rows)} prompts identical"
              + ("" if equal == len(rows) else " (first differences at " + ", ".join(
                  str(r["first_difference"]) for r in rows if not r["equal"]) + ")")
              + f"; batch 1: {'identical' if batch1['equal'] else 'first difference at ' + str(batch1['first_difference'])}")
    print(f"tau over all levels: {tau:.2f} ({label})")
    plot_path = os.path.join(out_dir, f"{stem}.png")
    try:
        write_plot(plot_path, levels, predictions and {c: p["predicted_tok_s"] for c, p in predictions.items()},
                   result["description"])
        print(f"plot -> {plot_path}")
    except ImportError as exc:
        print(f"plot skipped: {exc}")
    print(f"wrote {args.out}: python -m spec_kernels.policy --costs {args.out} --acceptance {args.out}")
    return 0 if result["greedy_check"]["all_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
