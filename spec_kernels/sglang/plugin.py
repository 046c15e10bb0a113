"""SGLang plugin: registers the `specfused` attention backend.

SGLang (0.5.23) calls every function of the entry-point group ``sglang.srt.plugins`` early
in each of its processes (``sglang.srt.plugins.load_plugins``; spawned workers load them
again), then applies the hooks registered with ``HookRegistry``. Ours, declared in
pyproject.toml as ``specfused = "spec_kernels.sglang.plugin:register"``:

1. adds ``specfused`` to the ``--attention-backend`` choices (so argument parsing accepts it
   and ``launch_server --help`` lists it);
2. registers a factory for it in SGLang's attention registry;
3. hooks how a draft model runner picks its backend: SGLang's EAGLE draft worker inherits the
   target's ``--attention-backend`` unless ``--speculative-draft-attention-backend`` is given,
   and its draft-backend factory only knows SGLang's own backends. With the target on
   specfused and no draft backend named, the hook gives the draft flashinfer (on a GPU with
   flashinfer installed) or triton. Set SPEC_KERNELS_SGLANG_DRAFT_HOOK=0 to leave SGLang's
   choice alone (then pass the flag);
4. only when SPEC_KERNELS_SGLANG_FUSED_ALLREDUCE is set (off by default): hooks that run the
   tensor-parallel allreduce + residual add + RMSNorm on spec_kernels.comm.FusedAllReduce
   (hooks.py). SPEC_KERNELS_SGLANG_DRAFT_SLOTS is recognised but installs nothing (hooks.py and
   docs/sglang.md say why).

Without SGLang installed, `register` does nothing and returns False. SGLang is imported only
inside the functions here, so importing this module never requires it.
"""
from __future__ import annotations

import importlib.util
import logging
import os

logger = logging.getLogger(__name__)

BACKEND_NAME = "specfused"
DRAFT_HOOK_ENV = "SPEC_KERNELS_SGLANG_DRAFT_HOOK"
DRAFT_HOOK_TARGET = "sglang.srt.model_executor.model_runner.resolve_draft_attention_backend"


def sglang_available() -> bool:
    return importlib.util.find_spec("sglang") is not None


def create_specfused_backend(model_runner):
    """The factory SGLang's registry calls with a ModelRunner (imports the backend lazily)."""
    from .backend import SpecFusedAttnBackend

    return SpecFusedAttnBackend(model_runner)


def default_draft_backend() -> str:
    """The draft model's backend when the target runs specfused and none was named."""
    import torch

    if torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer"
    return "triton"


def _draft_backend_hook(original, *args, **kwargs):
    # AROUND hook on resolve_draft_attention_backend(*, draft_attention_backend, is_draft_worker).
    chosen = original(*args, **kwargs)
    if chosen is not None or not kwargs.get("is_draft_worker", False):
        return chosen
    from sglang.srt.runtime_context import attention_backends

    if BACKEND_NAME not in attention_backends():
        return chosen
    chosen = default_draft_backend()
    logger.info("specfused: the draft model runs on SGLang's %s backend "
                "(set --speculative-draft-attention-backend to choose)", chosen)
    return chosen


def register() -> bool:
    """Entry point of the ``sglang.srt.plugins`` group. Idempotent; False without SGLang."""
    if not sglang_available():
        return False
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(create_specfused_backend)
        if os.environ.get(DRAFT_HOOK_ENV, "1") != "0":
            from sglang.srt.plugins.hook_registry import HookRegistry, HookType

            # Applied by load_plugins() after all plugins ran (HookRegistry.apply_hooks).
            HookRegistry.register(DRAFT_HOOK_TARGET, _draft_backend_hook, HookType.AROUND)
    # Optional hooks, each behind its environment variable; with none set nothing is registered.
    from . import hooks

    hooks.install_from_env()
    return True
