"""vLLM plug-in: LoRA on vLLM's CPU platform through this package's kernels.

Installed as the `vllm_cpu_lora` entry point of the `vllm.general_plugins`
group (see pyproject.toml), which vLLM loads in each of its processes (front
end, engine core, workers) before any LoRA layer exists. `register()` makes
the CPU platform's `get_punica_wrapper()` name
`vllm_cpu_lora.punica.PunicaWrapperCPULoRA`, so vLLM's LoRA model manager
builds that wrapper instead of `PunicaWrapperCPU`.

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
"""

import logging
import os

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
    logger.info(
        "vllm_cpu_lora: LoRA on CPU uses %s (kernels: ISA path %s, from %s)",
        WRAPPER,
        isa,
        os.path.dirname(punica.__file__),
    )
