"""The MovieLens-100K interactions, as shipped inside the ``recbole==1.2.1`` wheel on PyPI.

``ensure_ml100k(cache_dir)`` downloads the wheel with pip (once), extracts
``ml-100k.inter`` (tab-separated ``user_id, item_id, rating, timestamp`` with a header) into
the cache and returns its path; ``read_ratings`` reads it. The data is never committed.

    python -m freescale.data.ml100k [CACHE_DIR]     prints the path of ml-100k.inter
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import zipfile

WHEEL = "recbole==1.2.1"
MEMBER = "recbole/dataset_example/ml-100k/ml-100k.inter"


def ensure_ml100k(cache_dir: str = "runs/cache") -> str:
    target = os.path.join(cache_dir, "ml-100k.inter")
    if os.path.exists(target):
        return target
    os.makedirs(cache_dir, exist_ok=True)
    wheels = glob.glob(os.path.join(cache_dir, "recbole-1.2.1-*.whl"))
    if not wheels:
        print(f"[ml100k] downloading {WHEEL} into {cache_dir}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", cache_dir, WHEEL],
                       check=True)
        wheels = glob.glob(os.path.join(cache_dir, "recbole-1.2.1-*.whl"))
    with zipfile.ZipFile(wheels[0]) as z, open(target + ".tmp", "wb") as out:
        out.write(z.read(MEMBER))
    os.replace(target + ".tmp", target)
    return target


def user_history_lengths(path: str):
    """Events per user (the length of each user's full interaction history)."""
    import numpy as np

    from freescale.data.readers import read_ratings

    log = read_ratings(path)
    return np.bincount(log.users, minlength=log.num_users)


if __name__ == "__main__":
    print(ensure_ml100k(sys.argv[1] if len(sys.argv) > 1 else "runs/cache"))
