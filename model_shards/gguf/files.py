"""Which GGUF files a ``--model`` path names: one ``.gguf`` file, a directory holding one,
or the split shards ``NAME-00001-of-0000N.gguf`` (named by any shard or by their directory).

A directory with a ``config.json`` is a Hugging Face checkpoint, not a GGUF one, whatever
else it holds. Every mistake is a ``ValueError`` naming the path.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

SUFFIX = ".gguf"
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` is a ``.gguf`` file, or a directory without ``config.json``
    holding at least one (checked further by :func:`gguf_files`)."""
    p = Path(path)
    if p.is_file():
        return p.suffix == SUFFIX
    return p.is_dir() and not (p / "config.json").exists() and any(p.glob(f"*{SUFFIX}"))


def gguf_files(path: str | os.PathLike[str]) -> list[Path]:
    """The files of the GGUF checkpoint at ``path``, shard 1 first; ``ValueError`` naming
    the path when it holds none or several checkpoints, or a split shard is missing."""
    p = Path(path)
    if p.is_file():
        if p.suffix != SUFFIX:
            raise ValueError(f"--model {p}: not a directory nor a {SUFFIX} file")
        match = _SPLIT.match(p.name)
        return _split_files(p.parent, match["stem"], int(match["count"])) if match else [p]
    if not p.is_dir():
        raise ValueError(f"--model {p}: no such file or directory")
    found = sorted(p.glob(f"*{SUFFIX}"))
    if not found:
        raise ValueError(f"--model {p}: no {SUFFIX} file in that directory")
    splits = {(m["stem"], int(m["count"])) for f in found if (m := _SPLIT.match(f.name))}
    whole = [f for f in found if not _SPLIT.match(f.name)]
    if len(whole) + len(splits) > 1:
        names = sorted({f.name for f in whole} | {f"{s}-*-of-{c:05d}.gguf" for s, c in splits})
        raise ValueError(
            f"--model {p}: the directory holds several GGUF checkpoints ({', '.join(names)}); "
            f"name one file with --model"
        )
    if whole:
        return whole
    ((stem, count),) = splits
    return _split_files(p, stem, count)


def _split_files(directory: Path, stem: str, count: int) -> list[Path]:
    files = [directory / f"{stem}-{i:05d}-of-{count:05d}{SUFFIX}" for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(
            f"--model {directory / stem}: split GGUF shard(s) missing: {', '.join(missing)}"
        )
    return files
