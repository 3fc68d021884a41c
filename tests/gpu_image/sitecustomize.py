"""Put this folder on PYTHONPATH to run Python as on the GPU image: torchrec, fbgemm_gpu,
tensordict, iopath, redis-py and numba cannot be imported (they are installed here, absent there).

Python imports ``sitecustomize`` at start-up from the path, so every process started with this
folder first on PYTHONPATH (pytest, its subprocesses, a CLI) sees the same absence.
"""

import importlib.abc
import sys

BLOCKED = ("torchrec", "fbgemm_gpu", "tensordict", "iopath", "redis", "numba")


class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {fullname!r} (blocked: GPU image)")
        return None


sys.meta_path.insert(0, _Absent())
