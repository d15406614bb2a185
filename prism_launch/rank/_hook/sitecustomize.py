"""Activates a prism rank inside a Python started by a --no-python command."""

import os

if os.environ.get("PRISM_HOOK") == "1" and "RANK" in os.environ:
    os.environ["PRISM_HOOK"] = "0"  # only the first interpreter of the command becomes the rank
    from prism_launch.rank.bootstrap import RankContext, activate

    activate(RankContext.from_env())
    if os.environ.get("PRISM_MODE") in ("capture", "emulate"):
        import atexit

        from prism_launch.rank.bootstrap import finish

        atexit.register(finish)  # registered first, so it runs after the program's own handlers
