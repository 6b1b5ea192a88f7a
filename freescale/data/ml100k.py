"""The MovieLens-100K interactions, as shipped inside the ``recbole==1.2.1`` wheel on PyPI.

``ensure_ml100k(cache_dir)`` downloads the wheel with pip (once), extracts
``ml-100k.inter`` (tab-separated ``user_id, item_id, rating, timestamp`` with a header) into
the cache and returns its path; ``read_ratings`` reads it. ``ensure_ml100k_features`` extracts
the users' and items' side-feature files of the same wheel (``ml-100k.user``: age, gender,
occupation, zip code; ``ml-100k.item``: title, release year, genres) the same way. The data is
never committed.

    python -m freescale.data.ml100k [CACHE_DIR]     prints the path of ml-100k.inter
"""

from __future__ import annotations

import fcntl
import glob
import os
import subprocess
import sys
import zipfile

from freescale.data.errors import DataError

WHEEL = "recbole==1.2.1"
FOLDER = "recbole/dataset_example/ml-100k/"


def ensure_ml100k(cache_dir: str = "runs/cache") -> str:
    """The path of ``ml-100k.inter`` in ``cache_dir``, downloaded first if it is not there.

    Ranks of one host may call it at once: a lock file lets one download while the others
    wait, then find the file. A download that fails raises ``DataError`` with pip's last line.
    """
    return _ensure(cache_dir, "ml-100k.inter")


def ensure_ml100k_features(cache_dir: str = "runs/cache") -> tuple[str, str]:
    """The paths of ``ml-100k.user`` and ``ml-100k.item`` in ``cache_dir`` (as ``ensure_ml100k``)."""
    return _ensure(cache_dir, "ml-100k.user"), _ensure(cache_dir, "ml-100k.item")


def _ensure(cache_dir: str, name: str) -> str:
    target = os.path.join(cache_dir, name)
    if os.path.exists(target):
        return target
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        raise DataError(f"data.ratings.cache: cannot create {cache_dir}: {e.strerror}") from None
    with open(os.path.join(cache_dir, ".ml100k.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(target):
            _extract(cache_dir, name, target)
    return target


def _extract(cache_dir: str, name: str, target: str) -> None:
    wheels = glob.glob(os.path.join(cache_dir, "recbole-1.2.1-*.whl"))
    if not wheels:
        print(f"[ml100k] downloading {WHEEL} from PyPI into {cache_dir} (once)", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", cache_dir, WHEEL],
                              capture_output=True, text=True)
        wheels = glob.glob(os.path.join(cache_dir, "recbole-1.2.1-*.whl"))
        if proc.returncode != 0 or not wheels:
            last = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
            raise DataError(f"data.source ml100k: could not download {WHEEL} from PyPI"
                            f"{': ' + last[-1].strip() if last else ''}")
    try:
        with zipfile.ZipFile(wheels[0]) as z, open(target + ".tmp", "wb") as out:
            out.write(z.read(FOLDER + name))
    except (zipfile.BadZipFile, KeyError) as e:
        raise DataError(f"data.source ml100k: {wheels[0]} is not a usable recbole wheel ({e}); delete it to download again") from None
    os.replace(target + ".tmp", target)


def user_history_lengths(path: str):
    """Events per user (the length of each user's full interaction history)."""
    import numpy as np

    from freescale.data.readers import read_ratings

    log = read_ratings(path)
    return np.bincount(log.users, minlength=log.num_users)


if __name__ == "__main__":
    print(ensure_ml100k(sys.argv[1] if len(sys.argv) > 1 else "runs/cache"))
