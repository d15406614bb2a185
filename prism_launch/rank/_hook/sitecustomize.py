"""Activates a prism rank inside a Python started by a --no-python command."""

import os

from prism_launch.config.plan import PLAN_VAR

# Only the first interpreter of the command becomes the rank: the plan is taken out of the
# environment its children inherit.
_plan = os.environ.pop(PLAN_VAR, None) if "RANK" in os.environ else None
if _plan:
    from prism_launch.config.plan import RankPlan
    from prism_launch.rank.bootstrap import activate

    plan = RankPlan.from_env({PLAN_VAR: _plan})
    if plan.hook:
        activate(plan)
        if plan.mode in ("capture", "emulate"):
            import atexit

            from prism_launch.rank.bootstrap import finish

            atexit.register(finish)  # registered first, so it runs after the program's own handlers
