"""``prism-launch``: torchrun's command line, a PrismLLM config, one Launcher run."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from prism_launch.cli.args import parse
    from prism_launch.config import ConfigError, compose, resolve_defaults, validate
    from prism_launch.errors import PrismError
    from prism_launch.trace import TraceError

    args = parse(list(sys.argv[1:] if argv is None else argv))
    if args.local_rank_arg:  # deepspeed launcher flags: every rank's script gets --local_rank=N
        import os

        os.environ["PRISM_LOCAL_RANK_ARG"] = "1"
    if args.multirun and not args.print_config:
        from prism_launch.sweep import run_sweep

        try:
            return run_sweep(args)
        except KeyboardInterrupt as e:
            print(f"prism-launch: sweep interrupted ({e or 'SIGINT'}); all ranks stopped", file=sys.stderr)
            return 130
    try:
        cfg = compose(args.overrides)
        if args.nnodes and "target.nnodes" not in " ".join(args.overrides):
            cfg.target.nnodes = args.nnodes
        if "target.nproc_per_node" not in " ".join(args.overrides):
            cfg.target.nproc_per_node = args.nproc_per_node
        resolve_defaults(cfg)
        if args.print_config:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(OmegaConf.structured(cfg)), end="")
            return 0
        validate(cfg)
        from prism_launch.sweep import render_args

        args = render_args(cfg, args)  # target.parallel / script.args -> script args, before fingerprinting
        from prism_launch.modes.launcher import Launcher

        Launcher(cfg, args).run()
        return 0
    except ConfigError as e:
        print(f"prism-launch: error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"prism-launch: error: {e}", file=sys.stderr)
        return 2
    except (PrismError, TraceError) as e:
        print(f"prism-launch: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"prism-launch: interrupted ({e or 'SIGINT'}); all ranks stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
