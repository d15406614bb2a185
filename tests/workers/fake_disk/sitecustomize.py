"""Put on PYTHONPATH with PRISM_FAKE_FREE_BYTES=N: every ``shutil.disk_usage`` reports N bytes
free (a nearly full disk, without root or a tmpfs)."""

import os
import shutil

if os.environ.get("PRISM_FAKE_FREE_BYTES"):
    _free = int(os.environ["PRISM_FAKE_FREE_BYTES"])
    _real = shutil.disk_usage

    def disk_usage(path):
        u = _real(path)
        return type(u)(u.total, u.total - _free, _free)

    shutil.disk_usage = disk_usage
