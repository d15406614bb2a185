"""``prism-launch``: torchrun's command line, a PrismLLM config, one mode runner
(:func:`prism_launch.modes.run`), or a sweep of them."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from prism_launch.launch.args import parse
    from prism_launch.config import ConfigError, compose, resolve, validate
    from prism_launch.errors import PrismError
    from prism_launch.trace import TraceError

    args = parse(list(sys.argv[1:] if argv is None else argv))
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
