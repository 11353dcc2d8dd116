"""vLLM plug-in: LoRA on vLLM's CPU platform through this package's kernels.

Installed as the `vllm_cpu_lora` entry point of the `vllm.general_plugins`
group (see pyproject.toml), which vLLM loads in each of its processes (front
end, engine core, workers) before any LoRA layer exists. `register()` makes
the CPU platform's `get_punica_wrapper()` name
`vllm_cpu_lora.punica.PunicaWrapperCPULoRA`, so vLLM's LoRA model manager
builds that wrapper instead of `PunicaWrapperCPU`.

With the wrapper in place it also lets vLLM compile the model with LoRA:
vLLM's CPU platform compiles by default (`CompilationMode.DYNAMO_TRACE_ONCE`,
inductor) but sets `CompilationMode.NONE` as soon as a LoRA config exists,
since its own wrapper's per-batch Python state would be frozen into the
traced graph. This package's wrapper has none (see `vllm_cpu_lora.punica`),
so the platform's config step runs as it would without LoRA: the model gets
the mode it gets without LoRA, and `enforce_eager` or a compilation config
of the user's own still decide. It stays eager, with a logged reason, on a
vLLM release the suite does not run (its LoRA layers may read state that
the wrapper does not cover) and for pooling models (vLLM's classifier LoRA
heads read per-batch Python state themselves).

It changes nothing:

* on platforms other than vLLM's CPU platform;
* when `VLLM_CPU_LORA_DISABLE` is set to anything but "" or "0" (vLLM's own
  `PunicaWrapperCPU` and torch ops run then);
* when this package's C++ extension cannot be loaded (it logs why).

If `VLLM_PLUGINS` is set, it is an allow-list: name `vllm_cpu_lora` in it.

The vLLM releases it is tested with are `vllm_compat.TESTED_VLLM`. On
another release it logs one warning naming them and still routes LoRA
through its wrapper,
which works wherever vLLM's `PunicaWrapperCPU` keeps its methods (it does
across 0.32 and 0.33); if the wrapper cannot even be imported, vLLM's own
path stays, as when the extension cannot be loaded.

On vLLM's CPU platform it also asks Linux for the AMX tile state in each
process, whatever `VLLM_CPU_LORA_DISABLE` says: vLLM 0.33's CPU kernels use
AMX tiles (bf16) without asking, and a process that has not asked dies with
SIGILL at its first tile instruction (seen with and without LoRA). The
request changes no result; it is a no-op on CPUs without AMX.

Where it routes LoRA through its kernels, it turns on Python's
`faulthandler` in the process (unless something already did), so that a
crash there leaves the Python stack in the log.
"""

import logging
import os
from typing import Any

from vllm_cpu_lora import vllm_compat

__all__ = ["WRAPPER", "register"]

WRAPPER = "vllm_cpu_lora.punica.PunicaWrapperCPULoRA"
DISABLE_ENV = "VLLM_CPU_LORA_DISABLE"

# Under "vllm" so that vLLM's logging configuration (handler, level,
# format) applies to it.
logger = logging.getLogger("vllm.plugins." + __name__)

_done = False


def _disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "0").strip() not in ("", "0")


def _report_fatal_signals() -> None:
    """Makes a fatal signal in this process (a kernel's bad memory access,
    say) print every thread's Python stack to stderr, the server's log,
    before the process dies as it would anyway: vLLM then says only that
    its engine core died."""
    import faulthandler

    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)


def _warn_if_untested(version: str) -> None:
    """Warns if vLLM `version` is not one the suite runs on."""
    if not vllm_compat.is_tested(version):
        tested = ", ".join(f"{a}.{b}" for a, b in vllm_compat.TESTED_VLLM)
        logger.warning(
            "vllm_cpu_lora: tested with vLLM %s, this is vLLM %s; LoRA still "
            "runs through vllm_cpu_lora where vLLM's APIs it uses exist",
            tested,
            version,
        )


def _request_amx_tiles() -> None:
    """Asks Linux for this process's AMX tile state (see module doc)."""
    import torch

    if not torch.cpu._is_amx_tile_supported():
        return
    if torch.cpu._init_amx():
        logger.debug("vllm_cpu_lora: AMX tile state granted to this process")
    else:
        logger.warning(
            "vllm_cpu_lora: the OS refused AMX tile state: vLLM's AMX "
            "kernels may fail with SIGILL"
        )


def _why_lora_stays_eager(vllm_config: Any, version: str) -> str | None:
    """Why a LoRA model must not be compiled, or None (see module doc)."""
    if not vllm_compat.is_tested(version):
        return f"vLLM {version} is not a release this package is tested with"
    runner = getattr(vllm_config.model_config, "runner_type", "generate")
    if runner != "generate":
        return (
            f"a {runner} model: vLLM's LoRA classifier heads read per-batch "
            "Python state"
        )
    return None


def _compile_with_lora(platform_cls: Any, version: str) -> None:
    """Makes the platform's config step choose the compilation mode for a
    LoRA model as it does without LoRA, where that is safe."""
    check_and_update_config = platform_cls.check_and_update_config.__func__

    def check_with_lora(cls: Any, vllm_config: Any) -> None:
        lora_config = vllm_config.lora_config
        if lora_config is None:
            check_and_update_config(cls, vllm_config)
            return
        reason = _why_lora_stays_eager(vllm_config, version)
        if reason is not None:
            check_and_update_config(cls, vllm_config)
            logger.warning(
                "vllm_cpu_lora: the LoRA model runs eager (compilation mode "
                "NONE): %s",
                reason,
            )
            return
        # The one place the platform reads the LoRA config is where it
        # turns compilation off.
        vllm_config.lora_config = None
        try:
            check_and_update_config(cls, vllm_config)
        finally:
            vllm_config.lora_config = lora_config
        logger.info(
            "vllm_cpu_lora: LoRA with compilation mode %s, as without LoRA",
            vllm_config.compilation_config.mode.name,
        )

    platform_cls.check_and_update_config = classmethod(check_with_lora)


def register() -> None:
    """Routes vLLM's CPU LoRA through `vllm_cpu_lora` (see module doc).

    Safe to call more than once, and in every process: only the first call
    in a process acts and logs.
    """
    global _done
    if _done:
        return
    _done = True

    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        logger.debug(
            "vllm_cpu_lora: platform %s is not vLLM's CPU platform; "
            "nothing to do",
            type(current_platform).__name__,
        )
        return

    _request_amx_tiles()

    if _disabled():
        logger.info(
            "vllm_cpu_lora: %s is set; vLLM's own CPU LoRA path is used",
            DISABLE_ENV,
        )
        return

    import vllm

    _warn_if_untested(vllm.__version__)
    try:
        import vllm_cpu_lora
        from vllm_cpu_lora import punica

        isa = vllm_cpu_lora.isa()
    except Exception:
        logger.exception(
            "vllm_cpu_lora: cannot load the LoRA kernels; vLLM's own CPU "
            "LoRA path is used"
        )
        return

    platform_cls = type(current_platform)
    platform_cls.get_punica_wrapper = classmethod(lambda cls: WRAPPER)
    _compile_with_lora(platform_cls, vllm.__version__)
    _report_fatal_signals()
    logger.info(
        "vllm_cpu_lora: LoRA on CPU uses %s (kernels: ISA path %s, from %s)",
        WRAPPER,
        isa,
        os.path.dirname(punica.__file__),
    )
