"""When does speculation pay? A throughput model of EAGLE vs plain decoding vs batch size.

    python -m spec_kernels.policy --costs COSTS.json --acceptance ACCEPTANCE.json [--out-dir DIR]

The model (closed loop: `concurrency` requests are always in flight, so the batch size B of every
decode step equals the concurrency):

* baseline: one step decodes B requests, one token each, in ``t_base(B)`` seconds
  -> ``B / t_base(B)`` tok/s.
* EAGLE with n draft tokens per request (a chain, or a tree of n nodes): one step drafts and
  verifies, in ``t_eagle(B, n)`` seconds, and emits ``tau(n)`` tokens per request on average,
  the accepted drafts plus the bonus token the target model always produces (so ``1 <= tau <= n``)
  -> ``B * tau(n) / t_eagle(B, n)`` tok/s.
* the policy at each B: whichever is fastest. It picks the max of the candidates' predictions, so
  it never predicts a configuration slower than the better of baseline and EAGLE.
* an adaptive server (SGLang's ``--speculative-adaptive``: one server, chains only, drafting
  switched per batch size) at each B: the fastest of its chains and its steps-0 tier. That tier
  still runs SGLang's EAGLE worker (a 1-token verify, the draft's extend), so where the cost file
  measured it (``eagle_off`` rows, ``serve_check --measure-off``) its cost is used, and the table
  says where a plain server would beat the adaptive one; without it, drafting off is taken to cost
  what plain decoding costs.

What the step times contain is whatever the cost file says (see ``model.load_costs``):

* from the decode-step benchmark (``kind: decode_step`` results): the timed unit (usually ONE
  transformer layer: attention, GEMMs, allreduce + RMSNorm, and for EAGLE the KV slot alloc and
  commit) times ``layers``. NOT timed there: embedding, lm_head and sampling, the draft model's
  forward passes (unless ``mode: draft`` results are given; they are added to EAGLE's step),
  the scheduler and other host work, prefill of arriving requests. ``--overhead-s`` adds a fixed
  time per step to both modes for what is missing.
* from a hand-written cost file: whole steps as measured in a server, everything included.

Costs between measured batch sizes are linear in B (segments between neighbouring measurements);
each curve is first made non-decreasing in B (a larger batch never takes less time per step: a dip
is noise). Below the smallest measured B a curve holds its first value; above the largest it
continues its last segment (marked ``*`` in the table). Tree sizes without EAGLE measurements are
an error unless ``--interpolate-n``: then t_eagle(B, n) is linear in n between the measured sizes
at the same B, starting from plain decode plus ``--draft-fixed-s`` (the part of an EAGLE step that
does not grow with n: draft passes, draft extend; default 0) at n = 1. Costs usually grow slower
than linearly in tokens (GEMMs get more efficient), so the line underestimates intermediate sizes:
interpolated predictions favour speculation.

Other assumptions: tau does not depend on B or on the context length; every request generates
until the end (prefill, stragglers and queueing are not modelled); one configuration for the whole batch.

Outputs: a table per concurrency, the crossover batch sizes of each configuration against
baseline, the tau each configuration would need to tie baseline, SGLang's
``--speculative-adaptive-config`` JSON (see ``model.sglang_adaptive_config``) and a PNG plot.
"""
from .model import (
    AdaptivePrediction,
    AllReduceCost,
    CostModel,
    Curve,
    SpecConfig,
    crossovers,
    load_acceptance,
    load_costs,
    predict,
    predict_adaptive,
    sglang_adaptive_config,
)

__all__ = [
    "AdaptivePrediction",
    "AllReduceCost",
    "CostModel",
    "Curve",
    "SpecConfig",
    "crossovers",
    "load_acceptance",
    "load_costs",
    "predict",
    "predict_adaptive",
    "sglang_adaptive_config",
]
