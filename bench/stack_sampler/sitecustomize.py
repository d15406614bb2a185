"""Wall-clock stack sampler for any Python process started with this folder on ``PYTHONPATH``
and ``PRISM_STACK_SAMPLES=<dir>`` set (benches only: where a capture's time goes). Every 5 ms it
records each thread's innermost frames; every 2 s it rewrites ``<dir>/<pid>.json`` with the
process's command line (a forked rank's: its parent's) and rank and, per thread name, the sample counts of its stacks (innermost last)."""

import os

if os.environ.get("PRISM_STACK_SAMPLES"):
    import collections
    import json
    import sys
    import threading
    import time

    _dir = os.environ["PRISM_STACK_SAMPLES"]
    _depth = int(os.environ.get("PRISM_STACK_DEPTH", "8"))

    def _run() -> None:
        counts: dict = collections.defaultdict(collections.Counter)
        names = {}
        me = threading.get_ident()
        last = time.monotonic()
        os.makedirs(_dir, exist_ok=True)
        path = os.path.join(_dir, f"{os.getpid()}.json")
        while True:
            time.sleep(0.005)
            for t in threading.enumerate():
                names[t.ident] = t.name
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                stack = []
                f = frame
                while f is not None and len(stack) < _depth:
                    co = f.f_code
                    stack.append(f"{os.path.basename(co.co_filename)}:{co.co_name}:{f.f_lineno}")
                    f = f.f_back
                counts[names.get(ident, str(ident))][" < ".join(stack)] += 1
            if time.monotonic() - last > 2.0:
                last = time.monotonic()
                tmp = path + ".tmp"
                with open(tmp, "w") as fh:
                    json.dump({"argv": sys.argv, "rank": os.environ.get("RANK"), "threads": {k: dict(v.most_common(40)) for k, v in counts.items()},
                               "totals": {k: sum(v.values()) for k, v in counts.items()}}, fh)
                os.replace(tmp, path)

    def _start() -> None:
        threading.Thread(target=_run, name="prism-stack-sampler", daemon=True).start()

    _start()
    os.register_at_fork(after_in_child=_start)  # ranks are forks of a warm process
