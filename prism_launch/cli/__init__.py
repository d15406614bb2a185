"""``prism-launch``: torchrun's command line, a PrismLLM config, one mode runner
(:func:`prism_launch.modes.run`), or a sweep of them.

Every error ends the run with one plain message on stderr — a failing rank's own error first
(as torchrun's error summary), then what to do — and a non-zero exit: 2 for a bad command line
or config, 1 for a failed run, 128+signum when SIGINT/SIGTERM/SIGHUP stopped it (130, 143, 129,
as a shell expects). The launcher's own traceback is printed only with ``launch.debug=true`` or
``PRISM_DEBUG=1``."""

from __future__ import annotations

import errno
import os
import signal
import sys

_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _debug(cfg=None) -> bool:
    return os.environ.get("PRISM_DEBUG", "") not in ("", "0") or bool(cfg is not None and cfg.launch.debug)


def _on_signal(signum, _frame):
    from prism_launch.errors import Interrupted

    for s in _SIGNALS:  # one signal stops the run; a repeat must not cut the teardown short
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


def _report(e: BaseException, cfg) -> int:
    """Print ``e`` as prism-launch's one error message; returns the exit code."""
    import traceback

    from prism_launch.config import ConfigError
    from prism_launch.errors import Interrupted, PrismError
    from prism_launch.trace import TraceError

    if _debug(cfg):
        traceback.print_exception(e, file=sys.stderr)
    if isinstance(e, KeyboardInterrupt):
        code = e.exit_code if isinstance(e, Interrupted) else 130
        print(f"prism-launch: interrupted ({e or 'received SIGINT'}); all ranks stopped, no trace or report "
              "left half-written", file=sys.stderr)
        return code
    if isinstance(e, (ConfigError, FileNotFoundError)):
        print(f"prism-launch: error: {e}", file=sys.stderr)
        return 2
    if isinstance(e, (PrismError, TraceError)):
        print(f"prism-launch: error: {e}", file=sys.stderr)
        return 1
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        print(f"prism-launch: error: no space left on the device holding {e.filename or 'an output file'}; "
              "free space there or point trace.dir / report.dir elsewhere", file=sys.stderr)
        return 1
    if isinstance(e, PermissionError):
        print(f"prism-launch: error: {e}; fix the permissions or point trace.dir / report.dir / --log-dir "
              "at a writable directory", file=sys.stderr)
        return 1
    hint = "" if _debug(cfg) else " (launch.debug=true or PRISM_DEBUG=1 shows the launcher's traceback)"
    print(f"prism-launch: error: {type(e).__name__}: {e}{hint}", file=sys.stderr)
    return 1


def _help_config(argv: list[str]) -> int | None:
    """``--help-config [SECTION]``: the configuration reference (:mod:`prism_launch.config.reference`)."""
    if not argv or argv[0] != "--help-config":
        return None
    from prism_launch.config import reference

    return reference.main(argv[1:2] or [""])  # no section: every field, as text


def main(argv: list[str] | None = None) -> int:
    from prism_launch.launch.args import parse

    argv = list(sys.argv[1:] if argv is None else argv)
    shown = _help_config(argv)
    if shown is not None:
        return shown
    args = parse(argv)
    previous = {s: signal.signal(s, _on_signal) for s in _SIGNALS}
    cfg = None
    try:
        if args.multirun and not args.print_config:
            from prism_launch.sweep import run_sweep

            return run_sweep(args)
        from prism_launch.config import compose, resolve, validate

        cfg = compose(args.overrides)
        if args.nnodes and "target.nnodes" not in " ".join(args.overrides):
            cfg.target.nnodes = args.nnodes
        if "target.nproc_per_node" not in " ".join(args.overrides):
            cfg.target.nproc_per_node = args.nproc_per_node
        cfg = resolve(cfg)
        if args.print_config:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(OmegaConf.structured(cfg)), end="")
            return 0
        validate(cfg)
        from prism_launch.sweep import render_args

        args = render_args(cfg, args)  # target.parallel / script.args -> script args, before fingerprinting
        from prism_launch import modes

        modes.run(cfg, args)
        return 0
    except BaseException as e:  # noqa: BLE001 - every error becomes one message and an exit code
        if isinstance(e, SystemExit):
            raise
        if isinstance(e, KeyboardInterrupt):
            # stopped by a signal: a repeat stays ignored until the process has exited (restored,
            # the default action would kill the exiting launcher and lose its exit code, 129 / 143)
            previous = dict.fromkeys(_SIGNALS, signal.SIG_IGN)
        return _report(e, cfg)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
