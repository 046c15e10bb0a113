"""`python -m spec_kernels.comm.topo`: the measured topology of the visible GPUs.

* GPUs: name, PCI address, NUMA node (sysfs), and how each pair is connected on PCIe: under one
  switch, one root complex, or different root complexes (from the sysfs device paths);
* NVLink: from `nvidia-smi topo -m` when nvidia-smi exists (matched to CUDA indices by PCI id);
* P2P, per ordered pair (a -> b): the driver's claim, then the verdict of the P2P self-test that
  FusedAllReduce runs before it trusts CUDA IPC (spec_kernels.comm.p2p_check): one process per
  GPU maps every other's buffer through CUDA IPC; rank a's kernels write a pattern into b's
  buffer and read it back, b checks what arrived, a reads b's own data ("P2P self-test: pass"
  or "FAIL (why)"). With one GPU, two processes on it check the IPC path our one-GPU tests rely on;
* a probe per pair that passed: kernel-driven P2P write and read bandwidth (slow writes are the known
  trap on some switch hosts: flagged when writes reach < 50% of reads) and the latency of a
  dependent P2P load chain.

Without GPUs it says so and exits 0. ``--json`` prints the report as JSON; ``--no-probe`` skips
the processes (static information only). When the report has no GPUs or no GPU pairs, its
"reason" says why (no CUDA GPU visible, and why torch sees none; one GPU only); else it is null.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Optional

import torch

SLOW_WRITE_RATIO = 0.5


# --------------------------------------------------------------------------- static facts
def pci_address(index: int) -> Optional[str]:
    """Sysfs-style PCI address (0000:3b:00.0) of CUDA device `index`, if torch knows it."""
    p = torch.cuda.get_device_properties(index)
    if not hasattr(p, "pci_bus_id"):
        return None
    return f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"


def pci_path(address: str, sysfs: str = "/sys") -> list[str]:
    """Components of the device's sysfs path below /sys/devices: [host bridge, bridges..., device]."""
    link = os.path.join(sysfs, "bus", "pci", "devices", address)
    real = os.path.realpath(link)
    base = os.path.realpath(os.path.join(sysfs, "devices"))
    if not os.path.exists(link) or not real.startswith(base + os.sep):
        return []
    return real[len(base) + 1:].split(os.sep)


def numa_node(address: str, sysfs: str = "/sys") -> Optional[int]:
    try:
        with open(os.path.join(sysfs, "bus", "pci", "devices", address, "numa_node")) as f:
            node = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return None if node < 0 else node


def pcie_relation(path_a: list[str], path_b: list[str]) -> str:
    """How two devices meet on PCIe, from their sysfs paths ([pciDDDD:BB, port, (switch ports...), dev])."""
    if not path_a or not path_b:
        return "unknown (no sysfs path)"
    if path_a[0] != path_b[0]:
        return "different root complexes"  # traffic crosses the CPU interconnect (or host bridges)
    common = 0
    for x, y in zip(path_a[:-1], path_b[:-1]):
        if x != y:
            break
        common += 1
    # common == 1: only the host bridge is shared; a shared root port (2) or deeper means the
    # two devices sit below the same PCIe switch.
    return "same PCIe switch" if common >= 2 else "same root complex, different root ports"


def parse_nvidia_smi_topo(text: str) -> dict[tuple[str, str], str]:
    """`nvidia-smi topo -m` -> {(GPUa, GPUb): link} for GPU rows/columns ("NV12", "PIX", "SYS"...)."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln).rstrip() for ln in text.splitlines()]
    header = next((ln for ln in lines if ln[:1].isspace() and re.search(r"\bGPU0\b", ln)), None)
    if header is None:
        return {}
    cols = re.findall(r"GPU\d+", header)
    links = {}
    for ln in lines:
        m = re.match(r"^(GPU\d+)\s+(.*)$", ln)
        if m:
            for col, cell in zip(cols, m.group(2).split()):
                if col != m.group(1):
                    links[(m.group(1), col)] = cell
    return links


def nvidia_smi_links(addresses: list[Optional[str]]) -> tuple[Optional[dict], str]:
    """{(cuda a, cuda b): link} from nvidia-smi, or (None, why not)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None, "nvidia-smi not found"
    try:
        topo = subprocess.run([exe, "topo", "-m"], capture_output=True, text=True, timeout=30).stdout
        ids = subprocess.run([exe, "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"nvidia-smi failed ({exc})"
    smi_of_bus = {}
    for ln in ids.splitlines():
        idx, _, bus = ln.partition(",")
        if bus.strip():
            # nvidia-smi prints 00000000:3B:00.0; sysfs uses 0000:3b:00.0
            smi_of_bus[bus.strip().lower()[-12:]] = f"GPU{idx.strip()}"
    raw = parse_nvidia_smi_topo(topo)
    names = [smi_of_bus.get(a) if a else None for a in addresses]
    links = {}
    for a, na in enumerate(names):
        for b, nb in enumerate(names):
            if a != b and na and nb and (na, nb) in raw:
                links[(a, b)] = raw[(na, nb)]
    return links, "nvidia-smi topo -m"


# --------------------------------------------------------------------------- probe (GPU ranks)
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def copy_kernel(src, dst, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=ok), mask=ok)

    @triton.jit
    def chase_kernel(buf, out, steps):
        # Each load's address depends on the previous value: one full round trip per step.
        idx = tl.load(buf)
        for _ in range(steps):
            idx = tl.load(buf + idx)
        tl.store(out, idx)

    return copy_kernel, chase_kernel


def _copy(kernel, src, dst):
    n = src.numel()
    kernel[(triton_cdiv(n, 4096),)](src, dst, n, BLOCK=4096)


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _timed_us(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def _probe_worker(rank, world, size_mb, iters, claims):
    """Rank r (GPU r % count): the P2P self-test FusedAllReduce runs (spec_kernels.comm.p2p_check,
    over the extension's IPC buffers when it is built, else torch's CUDA IPC), then, for every
    ordered pair (a, b) that passed, in turn: rank a's kernels measure bandwidth and latency
    into and out of b's buffer."""
    import torch.distributed as dist
    from torch.multiprocessing.reductions import reduce_tensor

    from .._ops import extension_error
    from . import p2p_check

    dev = torch.device("cuda", torch.cuda.current_device())
    if extension_error() is None:
        transport, via = p2p_check.ExtensionIpcTransport(dev), "the CUDA extension's IPC buffers"
    else:
        transport, via = p2p_check.TorchIpcTransport(dev), "torch CUDA IPC (the CUDA extension is not loaded)"
    test = p2p_check.run_self_test(rank, world, p2p_check.group_gather(), transport)
    results = {"self_test_via": via, "self_test_local_error": test.local_error}
    copy_kernel, chase_kernel = _kernels()
    n = size_mb * (1 << 20) // 4
    mine = torch.zeros(n, dtype=torch.int32, device=dev)
    local = torch.empty_like(mine)
    exported = [None] * world
    dist.all_gather_object(exported, reduce_tensor(mine)[1])
    rebuild = reduce_tensor(mine)[0]
    for a in range(world):
        for b in range(world):
            if a == b:
                continue
            if rank == a:
                result = {"self_test": test.verdict(a, b)}
                if test.pairs[(a, b)] is None and not claims.get(f"{a},{b}", True):
                    result["error"] = "the driver reports no P2P access"
                elif test.pairs[(a, b)] is None:  # no figures for a pair that failed
                    try:
                        peer = rebuild(*exported[b])
                        local.copy_(peer)  # enables peer access between the two GPUs, if distinct
                        nbytes = n * 4
                        result["write_GBps"] = nbytes / _timed_us(lambda: _copy(copy_kernel, local, peer), iters) / 1e3
                        result["read_GBps"] = nbytes / _timed_us(lambda: _copy(copy_kernel, peer, local), iters) / 1e3
                        chain = peer.view(torch.int64)[: 1 << 16]
                        chain.copy_((torch.arange(chain.numel(), device=dev) + 4099) % chain.numel())
                        out = torch.empty(1, dtype=torch.int64, device=dev)
                        steps = 2000
                        us = _timed_us(lambda: chase_kernel[(1,)](chain, out, steps), 3)
                        result["read_latency_us"] = us / steps
                    except Exception as exc:  # noqa: BLE001 - reported per pair
                        result["error"] = f"bandwidth probe failed: {exc}"
                results[f"{a}->{b}"] = result
            dist.barrier()  # one pair at a time
    return results


# --------------------------------------------------------------------------- report
def empty_reason(count: int) -> Optional[str]:
    """Why a report of `count` visible GPUs has no GPUs or no GPU pairs (None from 2 GPUs on)."""
    if count == 1:
        return "one CUDA GPU visible: no GPU pairs to measure (the probe runs two processes on it instead)"
    if count > 1:
        return None
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} was built without CUDA"
    elif os.environ.get("CUDA_VISIBLE_DEVICES") is not None and not os.environ["CUDA_VISIBLE_DEVICES"].strip():
        why = "CUDA_VISIBLE_DEVICES is empty"
    else:
        why = "torch.cuda.is_available() is False: no NVIDIA driver or GPU found"
    return f"no CUDA GPU visible ({why}): nothing to probe"


def build_report(probe: bool = True, size_mb: int = 64, iters: int = 10, sysfs: str = "/sys") -> dict:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    report: dict = {"gpus": [], "pairs": [], "notes": [], "reason": empty_reason(count)}
    if count == 0:
        return report
    addrs = [pci_address(i) for i in range(count)]
    paths = [pci_path(a, sysfs) if a else [] for a in addrs]
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        report["gpus"].append({"index": i, "name": p.name, "pci": addrs[i],
                               "numa_node": numa_node(addrs[i], sysfs) if addrs[i] else None,
                               "sm": f"{p.major}{p.minor}", "memory_GiB": round(p.total_memory / 2**30)})
    links, source = nvidia_smi_links(addrs)
    if links is None:
        report["notes"].append(f"NVLink: unknown ({source})")
    claims = {}
    for a in range(count):
        for b in range(count):
            if a == b:
                continue
            claims[f"{a},{b}"] = torch.cuda.can_device_access_peer(a, b)
            link = links.get((a, b)) if links else None
            report["pairs"].append({"from": a, "to": b, "pcie": pcie_relation(paths[a], paths[b]),
                                    "nvidia_smi": link, "nvlink": bool(link and link.startswith("NV")),
                                    "driver_p2p": claims[f"{a},{b}"]})
    if not probe:
        return report
    from .launch import run_ranks

    world = max(count, 2)  # one GPU: two processes share it (the IPC path of our one-GPU tests)
    try:
        results = run_ranks(world, _probe_worker, size_mb, iters, claims, backend="gloo", timeout=600)
    except RuntimeError as exc:
        report["notes"].append(f"probe failed: {exc}")
        return report
    merged = {k: v for r in results for k, v in r.items()}
    report["self_test_via"] = merged.get("self_test_via")
    report["probe"] = []
    for a in range(world):
        for b in range(world):
            if a == b:
                continue
            entry = {"from_rank": a, "to_rank": b, "gpus": [a % count, b % count], **merged.get(f"{a}->{b}", {})}
            entry["proved"] = entry.get("self_test") == "pass"
            w, r = entry.get("write_GBps"), entry.get("read_GBps")
            entry["slow_writes"] = bool(w and r and w < SLOW_WRITE_RATIO * r)
            report["probe"].append(entry)
    errors = sorted({r["self_test_local_error"] for r in results if r.get("self_test_local_error")})
    report["notes"] += [f"P2P self-test error: {e}" for e in errors]
    return report


def format_report(report: dict) -> str:
    if not report["gpus"]:
        return report.get("reason") or "no CUDA GPU visible: nothing to probe"
    lines = ["GPUs:"]
    for g in report["gpus"]:
        lines.append(f"  {g['index']}: {g['name']} sm_{g['sm']} {g['memory_GiB']} GiB  PCI {g['pci']}  "
                     f"NUMA {g['numa_node']}")
    if report["pairs"]:
        lines.append("pairs (driver P2P claim, PCIe placement, nvidia-smi link):")
        for p in report["pairs"]:
            lines.append(f"  {p['from']} -> {p['to']}: p2p={'yes' if p['driver_p2p'] else 'NO'}  {p['pcie']}"
                         f"  {p['nvidia_smi'] or '-'}{'  NVLink' if p['nvlink'] else ''}")
    if report.get("probe"):
        lines.append(f"P2P self-test per ordered rank pair (kernels write and read the peer's memory through "
                     f"{report.get('self_test_via')}), then bandwidth and latency:")
    for e in report.get("probe", []):
        lines.append(format_probe_entry(e))
    if report.get("reason"):
        lines.append(report["reason"])
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def format_probe_entry(e: dict) -> str:
    where = f"  rank {e['from_rank']} (GPU {e['gpus'][0]}) -> rank {e['to_rank']} (GPU {e['gpus'][1]})"
    line = f"{where}: P2P self-test: {e.get('self_test', 'FAIL (no result from the rank)')}"
    if "error" in e:
        return f"{line}; {e['error']}"
    if "write_GBps" not in e:
        return line
    return (f"{line}; write {e['write_GBps']:.1f} GB/s, read {e['read_GBps']:.1f} GB/s, read latency "
            f"{e['read_latency_us']:.2f} us{'  SLOW P2P WRITES' if e['slow_writes'] else ''}")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m spec_kernels.comm.topo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--no-probe", action="store_true", help="static information only, no kernels")
    ap.add_argument("--size-mb", type=int, default=64, help="bandwidth probe buffer per pair, MiB (default 64)")
    ap.add_argument("--iters", type=int, default=10, help="timed copies per bandwidth figure (default 10)")
    return ap


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    report = build_report(probe=not args.no_probe, size_mb=args.size_mb, iters=args.iters)
    print(json.dumps(report, indent=1) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
