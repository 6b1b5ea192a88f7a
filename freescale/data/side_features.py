"""User and item side features of MovieLens, read from their files and made categorical.

Users: MovieLens-100K ``u.user`` (``user|age|gender|occupation|zip``), RecBole's
``ml-100k.user`` (tab-separated, header ``user_id:token age:token gender:token occupation:token
...``) and MovieLens-1M ``users.dat`` (``user::gender::age::occupation::zip``). Each user gets
``age`` (bucketed at 18, 25, 35, 45, 50, 56: MovieLens-1M's own age groups, so its codes map to
the same buckets as 100K's ages), ``gender`` and ``occupation``.

Items: MovieLens-100K ``u.item`` (``item|title|release date|video date|url|`` then 19 genre
flags), RecBole's ``ml-100k.item`` (header ``item_id:token movie_title:token_seq
release_year:token class:token_seq``) and MovieLens-1M ``movies.dat`` (``item::title
(year)::genre|genre``). Each item gets ``genre`` (multi-valued) and ``year`` (the release year
bucketed at ``YEAR_EDGES``).

A categorical feature's values map to ``0 .. num_values-1``: a bucketed one by its bucket, the
others by the sorted order of the distinct strings in the file (so the mapping is a function of
the file). A feature a user or item lacks (an empty field) is an empty list.

The files are small (one line per user or item), so they are read here in Python; the log itself
never is.
"""

from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass

from freescale.data.errors import DataError
from freescale.data.sample_files import SideFeature

AGE_EDGES = [18, 25, 35, 45, 50, 56]
"""Age buckets: under 18, 18-24, 25-34, 35-44, 45-49, 50-55, 56 and over (MovieLens-1M's groups)."""
YEAR_EDGES = [1930, 1940, 1950, 1960, 1970, 1980, 1985, 1990, 1995, 2000, 2005, 2010, 2015, 2020]
"""Release-year buckets: before 1930, the 1930s, ..., 1980-84, 1985-89, ..., 2020 and later."""
ML100K_GENRES = ["unknown", "Action", "Adventure", "Animation", "Children's", "Comedy", "Crime", "Documentary",
                 "Drama", "Fantasy", "Film-Noir", "Horror", "Musical", "Mystery", "Romance", "Sci-Fi", "Thriller",
                 "War", "Western"]
"""The genre flags of ``u.item``, in column order (MovieLens-100K's ``u.genre``)."""


@dataclass
class SideTable:
    """Side features keyed by the id as the log spells it."""

    keys: list[str]
    values: dict[str, list[list[int]]]
    """feature -> each key's values (indices in 0 .. num_values-1)."""
    features: list[SideFeature]


def read_users(path: str) -> SideTable:
    """``age``, ``gender`` and ``occupation`` of each user of a MovieLens user file."""
    lines = _lines(path)
    first = lines[0]
    if "::" in first:  # users.dat: user::gender::age::occupation::zip
        rows = _split(path, lines, "::", 5)
        keys, age, gender, occupation = [r[0] for r in rows], [r[2] for r in rows], [r[1] for r in rows], [r[3] for r in rows]
    elif "\t" in first and ":token" in first:  # RecBole .user
        names = [n.split(":", 1)[0] for n in first.split("\t")]
        rows = _split(path, lines[1:], "\t", len(names), start=2)
        col = {n: [r[i] for r in rows] for i, n in enumerate(names)}
        _require(path, col, ["user_id", "age", "gender", "occupation"])
        keys, age, gender, occupation = col["user_id"], col["age"], col["gender"], col["occupation"]
    else:  # u.user: user|age|gender|occupation|zip
        rows = _split(path, lines, "|", 5)
        keys, age, gender, occupation = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows]
    ages = [_bucket(path, "age", a, AGE_EDGES, strict=True) for a in age]
    features = {"age": (ages, len(AGE_EDGES) + 1), **_categorical({"gender": gender, "occupation": occupation})}
    return _table(keys, features, path)


def read_items(path: str) -> SideTable:
    """``genre`` and ``year`` of each item of a MovieLens item file."""
    lines = _lines(path)
    first = lines[0]
    if "::" in first:  # movies.dat: item::title (year)::genre|genre
        rows = _split(path, lines, "::", 3)
        keys = [r[0] for r in rows]
        years = [_title_year(r[1]) for r in rows]
        genres = [[g for g in r[2].split("|") if g and g != "(no genres listed)"] for r in rows]
    elif "\t" in first and ":token" in first:  # RecBole .item
        names = [n.split(":", 1)[0] for n in first.split("\t")]
        rows = _split(path, lines[1:], "\t", len(names), start=2)
        col = {n: [r[i] for r in rows] for i, n in enumerate(names)}
        _require(path, col, ["item_id", "release_year", "class"])
        keys, years, genres = col["item_id"], col["release_year"], [c.split() for c in col["class"]]
    else:  # u.item: item|title|release date|video release date|url|19 genre flags
        rows = _split(path, lines, "|", 5 + len(ML100K_GENRES))
        keys = [r[0] for r in rows]
        years = [r[2][-4:] if r[2] else "" for r in rows]
        genres = [[g for g, flag in zip(ML100K_GENRES, r[5:]) if flag == "1"] for r in rows]
    year_values = [_bucket(path, "year", y, YEAR_EDGES, strict=False) for y in years]
    features = {"genre": _categorical({"genre": genres})["genre"], "year": (year_values, len(YEAR_EDGES) + 1)}
    return _table(keys, features, path)


def _lines(path: str) -> list[str]:
    if not os.path.isfile(path):
        raise DataError(f"side-feature file not found: {path}")
    # MovieLens' item files are Latin-1 (titles); every byte is a character there.
    with open(path, encoding="latin-1") as f:
        lines = [line.rstrip("\r\n") for line in f if line.strip()]
    if not lines:
        raise DataError(f"{path}: empty side-feature file")
    return lines


def _split(path: str, lines: list[str], sep: str, count: int, start: int = 1) -> list[list[str]]:
    rows = []
    for lineno, line in enumerate(lines, start):
        fields = [x.strip() for x in line.split(sep)]
        if len(fields) != count:
            raise DataError(f"{path}:{lineno}: expected {count} fields separated by {sep!r}, got {len(fields)}")
        if not fields[0]:
            raise DataError(f"{path}:{lineno}: empty id")
        rows.append(fields)
    return rows


def _require(path: str, columns: dict, names: list[str]) -> None:
    missing = [n for n in names if n not in columns]
    if missing:
        raise DataError(f"{path}: no column {', '.join(repr(m) for m in missing)} in the header "
                        f"(columns: {', '.join(columns)})")


def _bucket(path: str, name: str, text: str, edges: list[int], *, strict: bool) -> list[int]:
    """``[bucket]`` of a number, ``[]`` for an empty field (and, not ``strict``, for any other
    text: ml-100k.item spells one unknown year 'unkonwn')."""
    if not text:
        return []
    try:
        value = float(text)
    except ValueError:
        if not strict:
            return []
        raise DataError(f"{path}: {name} must be a number, got {text!r}") from None
    return [bisect.bisect_right(edges, value)]


def _title_year(title: str) -> str:
    m = re.search(r"\((\d{4})\)\s*$", title)
    return m.group(1) if m else ""


def _categorical(columns: dict[str, list]) -> dict[str, tuple[list[list[int]], int]]:
    """Each column's strings (or lists of strings) as indices into its sorted distinct values."""
    out = {}
    for name, column in columns.items():
        lists = [v if isinstance(v, list) else ([v] if v else []) for v in column]
        vocab = {v: i for i, v in enumerate(sorted({v for values in lists for v in values}))}
        out[name] = ([[vocab[v] for v in values] for values in lists], len(vocab))
    return out


def _table(keys: list[str], features: dict[str, tuple[list[list[int]], int]], path: str) -> SideTable:
    if len(set(keys)) != len(keys):
        seen = set()
        twice = next(k for k in keys if k in seen or seen.add(k))
        raise DataError(f"{path}: id {twice!r} appears twice")
    return SideTable(keys=keys, values={name: values for name, (values, _) in features.items()},
                     features=[SideFeature(name, max(num, 1), max((len(v) for v in values), default=0))
                               for name, (values, num) in features.items()])
