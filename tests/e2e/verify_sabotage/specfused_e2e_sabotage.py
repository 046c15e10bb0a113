"""Test-only SGLang plugin: the negative control of tests/e2e (never installed with the package).

When the file named by $SPEC_KERNELS_E2E_SABOTAGE_FLAG exists, every verify forward of the
``specfused`` backend gets "chain" ancestor words instead of the real tree mask: each draft then
attends to every earlier draft, its siblings and their subtrees included. That is the densest
mask the op accepts (a draft that sees a later draft is refused with a ValueError, so an
all-visible mask would only crash the server), and it is wrong for every tree. The greedy
outputs of an EAGLE-3 tree server must then differ from plain decoding's; if they did not, the
equality checks of tests/e2e could not detect a wrong verify mask.

tests/e2e/conftest.py puts this directory on the server's PYTHONPATH together with a
``*.dist-info`` entry point (group ``sglang.srt.plugins``) that it writes at test time, so
SGLang loads the plugin in each of its processes like any other. The flag is checked per
verify batch, so one server runs both the equality checks and the negative control.
"""
import os

FLAG_ENV = "SPEC_KERNELS_E2E_SABOTAGE_FLAG"
TARGET = "spec_kernels.sglang.backend.SpecFusedAttnBackend._draft_words"


def _earlier_drafts_visible_when_flagged(original, self, spec_info, prefix_lens, bs, n):
    words = original(self, spec_info, prefix_lens, bs, n)
    flag = os.environ.get(FLAG_ENV)
    if flag and os.path.exists(flag):
        from spec_kernels.sglang import masks

        return masks.chain_words(bs * n, n, words.device)
    return words


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, _earlier_drafts_visible_when_flagged, HookType.AROUND)
