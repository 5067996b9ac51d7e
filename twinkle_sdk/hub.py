"""Resolve model and dataset ids to local directories, from local caches only.

Ids look like the seed scripts': a local path, `hf://org/name` (Hugging Face) or
`ms://org/name` (ModelScope). twinkle_sdk never downloads: GPU boxes are often offline and a
silent multi-GB download in the middle of a training script is worse than a clear error, so
a hub id must already be in its hub's local cache (or be given as a local directory).
"""

from __future__ import annotations

import os
from pathlib import Path

HF_PREFIX = "hf://"
MS_PREFIX = "ms://"


def split_hub_id(id_or_path: str) -> tuple[str | None, str]:
    """`hf://org/name` -> ("hf", "org/name"); `ms://...` -> ("ms", ...); else (None, id)."""
    for scheme, prefix in (("hf", HF_PREFIX), ("ms", MS_PREFIX)):
        if id_or_path.startswith(prefix):
            repo_id = id_or_path[len(prefix):].strip("/")
            if repo_id.count("/") != 1 or ".." in repo_id.split("/"):
                raise ValueError(f"{id_or_path!r}: a hub id must look like {prefix}org/name")
            return scheme, repo_id
    return None, id_or_path


def modelscope_cache_root() -> Path:
    """ModelScope's hub cache: $MODELSCOPE_CACHE, else ~/.cache/modelscope/hub."""
    env = os.environ.get("MODELSCOPE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "modelscope" / "hub"


def modelscope_cache_dirs(repo_id: str, kind: str) -> list[Path]:
    """Where ModelScope may have put `repo_id` (kind "models" or "datasets"), best first.

    Layouts differ between modelscope versions: models under `<root>/models/org/name` (new)
    or `<root>/org/name` (old), datasets under `<root>/datasets/org/name`; some versions store
    `.` in names as `___`, and $MODELSCOPE_CACHE may name the parent of `hub/`. We look in
    all of them rather than import modelscope (not a dependency).
    """
    root = modelscope_cache_root()
    names = [repo_id]
    if "." in repo_id:
        names.append(repo_id.replace(".", "___"))
    roots = [root, root / "hub"]
    out: list[Path] = []
    for r in roots:
        for name in names:
            out.append(r / kind / name)
            if kind == "models":
                out.append(r / name)
    return out


def find_modelscope_dir(repo_id: str, kind: str) -> Path | None:
    for cand in modelscope_cache_dirs(repo_id, kind):
        if cand.is_dir() and any(cand.iterdir()):
            return cand
    return None


def hf_cache_dir(repo_id: str, repo_type: str = "model") -> Path | None:
    """The cached snapshot of a Hugging Face repo, or None; never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, local_files_only=True))
    except (LocalEntryNotFoundError, OSError):
        return None


def _not_cached(model_id: str, where: str, how: str) -> ValueError:
    return ValueError(
        f"model {model_id!r} is not in the local {where}, and twinkle_sdk does not download. "
        f"Download it first ({how}) or pass the path of a local model directory."
    )


def resolve_model_dir(model_id: str | os.PathLike[str]) -> Path:
    """The local directory of a model (config, tokenizer, weights) named by `model_id`.

    Accepts a local directory, `hf://org/name`, `ms://org/name`, or a bare `org/name` (tried in
    the Hugging Face cache, then the ModelScope cache). Raises ValueError naming the id and
    how to provide it when it is not available locally.
    """
    from huggingface_hub import constants

    text = os.fspath(model_id)
    scheme, repo_id = split_hub_id(text)
    if scheme is None:
        path = Path(text).expanduser()
        if path.is_dir():
            return path
        if path.exists():
            raise ValueError(f"model {text!r} is a file; pass the model's directory")
        looks_like_repo = text.count("/") == 1 and not text.startswith((".", "/", "~"))
        if not looks_like_repo:
            raise ValueError(f"model {text!r}: no such directory")
        found = hf_cache_dir(text) or find_modelscope_dir(text, "models")
        if found is not None:
            return found
        raise ValueError(
            f"model {text!r} is neither a local directory nor in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}) or ModelScope cache ({modelscope_cache_root()}), and "
            f"twinkle_sdk does not download. Download it first (`hf download {text}` or "
            f"`modelscope download --model {text}`) or pass a local directory."
        )
    if scheme == "hf":
        found = hf_cache_dir(repo_id)
        if found is None:
            raise _not_cached(text, f"Hugging Face cache ({constants.HF_HUB_CACHE})",
                              f"`hf download {repo_id}`")
        return found
    found = find_modelscope_dir(repo_id, "models")
    if found is None:
        raise _not_cached(text, f"ModelScope cache ({modelscope_cache_root()})",
                          f"`modelscope download --model {repo_id}`")
    return found
