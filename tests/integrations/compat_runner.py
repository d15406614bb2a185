"""Run a training script on CPU through the CUDA compatibility layer.

Usage (under torchrun)::

    torchrun --nproc-per-node N tests/integrations/compat_runner.py [--late-install] SCRIPT [ARGS...]

``--late-install`` imports ``megatron.core`` (and the usual submodules)
before installing the layer, as a launcher that forks ranks from a parent
process that already imported them would.
"""

import os
import runpy
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def main():
    argv = sys.argv[1:]
    late = False
    if argv and argv[0] == "--late-install":
        late = True
        argv = argv[1:]
    if not argv:
        raise SystemExit(__doc__)
    if late:
        import megatron.core  # noqa: F401
        import megatron.core.models.gpt  # noqa: F401
        import megatron.core.optimizer  # noqa: F401
        import megatron.core.pipeline_parallel  # noqa: F401
        import megatron.core.tensor_parallel  # noqa: F401
    from integrations import cpu_compat, megatron_compat

    cpu_compat.install()
    megatron_compat.install()
    script = argv[0]
    sys.argv = argv
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
