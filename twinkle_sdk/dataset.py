"""Dataset: load rows from local files or a hub cache, preprocess them, encode them.

A thin wrapper over a Hugging Face `datasets.Dataset` (Arrow, memory-mapped, cached maps), with
the seed scripts' calls: `Dataset(DatasetMeta(...))`, `set_template`, `map`, `encode`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from twinkle_sdk.hub import find_modelscope_dir, hf_cache_dir, modelscope_cache_root, split_hub_id
from twinkle_sdk.preprocessor import get_preprocessor
from twinkle_sdk.template import Template, get_template

# File suffix -> datasets builder. Preferred first, when a directory holds several formats
# (hub snapshots often carry a parquet export next to the original json).
FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}
# JSON files that describe a dataset rather than hold its rows.
_METADATA_FILES = {"dataset_info.json", "dataset_infos.json", "state.json", "dataset_dict.json",
                   "configuration.json", "config.json"}
_SPLIT_NAMES = ("train", "test", "validation", "valid", "dev", "eval")
# Keyword arguments of `datasets.Dataset.map` that `map`/`encode` pass through; others (the
# seed scripts' names for other backends) are accepted and ignored.
_MAP_KWARGS = ("load_from_cache_file", "num_proc", "keep_in_memory", "desc", "batch_size",
               "cache_file_name", "writer_batch_size")


@dataclass
class DatasetMeta:
    """What to load: a local file/directory, `hf://org/name` or `ms://org/name`.

    `subset_name` picks a configuration (a sub-directory, e.g. GSM8K's "main"), `split` a
    split, `data_slice` (range, slice or list of indices) rows; indices past the end are
    dropped, so `range(1000)` on a 100-row set gives all 100 rows.
    """

    id_or_path: str
    subset_name: str | None = None
    split: str = "train"
    data_slice: range | slice | Sequence[int] | None = None


class Dataset:
    """Rows of a dataset; after `encode()`, dicts with `input_ids` and `labels`."""

    def __init__(self, dataset_meta: DatasetMeta | str) -> None:
        if isinstance(dataset_meta, str):
            dataset_meta = DatasetMeta(dataset_meta)
        self.dataset_meta = dataset_meta
        self.template: Template | None = None
        self.hf_dataset = select_rows(load_hf_dataset(dataset_meta), dataset_meta.data_slice)

    def set_template(self, name_or_template: str | Template | type[Template] = "Template",
                     model_id: Any = None, max_length: int | None = None,
                     **kwargs: Any) -> Template:
        self.template = get_template(name_or_template, model_id=model_id,
                                     max_length=max_length, **kwargs)
        return self.template

    def map(self, preprocessor: Any, init_args: dict[str, Any] | None = None,
            **kwargs: Any) -> Dataset:
        """Apply a preprocessor (instance, class or registered name); None results drop rows."""
        fn = get_preprocessor(preprocessor, init_args)
        self.hf_dataset = map_rows(self.hf_dataset, fn, **kwargs)
        return self

    def encode(self, batched: bool = True, add_generation_prompt: bool = False,
               **kwargs: Any) -> Dataset:
        """Run the template over every row (see `Template.encode`)."""
        if self.template is None:
            raise ValueError("call dataset.set_template(...) before dataset.encode()")
        template = self.template

        def encode_row(row: dict[str, Any]) -> dict[str, Any]:
            return template.encode(row, add_generation_prompt=add_generation_prompt)

        if not batched:
            kwargs["batch_size"] = 1
        self.hf_dataset = map_rows(self.hf_dataset, encode_row, **kwargs)
        return self

    def __len__(self) -> int:
        return len(self.hf_dataset)

    def __getitem__(self, index: int | slice) -> dict[str, Any] | list[dict[str, Any]]:
        if isinstance(index, slice):
            return self.__getitems__(list(range(len(self))[index]))
        return self.hf_dataset[index]

    def __getitems__(self, indices: list[int]) -> list[dict[str, Any]]:
        # One Arrow read for a whole batch instead of one per row.
        return _rows_of(self.hf_dataset[list(indices)]) if indices else []

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.hf_dataset)

    def __repr__(self) -> str:
        return (f"Dataset({self.dataset_meta.id_or_path!r}, rows={len(self)}, "
                f"columns={self.hf_dataset.column_names})")


def _rows_of(columns: dict[str, list[Any]]) -> list[dict[str, Any]]:
    n = len(next(iter(columns.values()))) if columns else 0
    return [{k: v[i] for k, v in columns.items()} for i in range(n)]


def map_rows(ds: Any, fn: Callable[[dict[str, Any]], dict[str, Any] | None],
             **kwargs: Any) -> Any:
    """`ds.map` with a row function that may drop rows (return None) or change columns.

    Batched, with all input columns removed, because that is the form of `datasets.map` that
    lets the number of rows and the column set change.
    """

    def apply(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        out = [r for r in map(fn, _rows_of(batch)) if r is not None]
        keys: dict[str, None] = {}
        for r in out:
            keys.update(dict.fromkeys(r))
        return {k: [r.get(k) for r in out] for k in keys}

    map_kwargs = {k: v for k, v in kwargs.items() if k in _MAP_KWARGS}
    # datasets fingerprints `fn` by pickling it, and classes pickle by reference: after an
    # upgrade of twinkle_sdk (or an edit of your Preprocessor) a cached result of the old code
    # would be reused. Recomputing is cheap next to training, so reuse only on request.
    map_kwargs.setdefault("load_from_cache_file", False)
    return ds.map(apply, batched=True, remove_columns=ds.column_names, **map_kwargs)


def select_rows(ds: Any, data_slice: range | slice | Sequence[int] | None) -> Any:
    if data_slice is None:
        return ds
    n = len(ds)
    if isinstance(data_slice, slice):
        indices = list(range(n)[data_slice])
    elif isinstance(data_slice, (range, Sequence)) and not isinstance(data_slice, str):
        indices = [i + n if i < 0 else i for i in data_slice]
        indices = [i for i in indices if 0 <= i < n]
    else:
        raise TypeError(f"data_slice must be a range, slice or list of indices, "
                        f"not {type(data_slice).__name__}")
    return ds.select(indices)


def load_hf_dataset(meta: DatasetMeta) -> Any:
    """The `datasets.Dataset` that `meta` names (one split), from local data only."""
    scheme, repo_id = split_hub_id(meta.id_or_path)
    if scheme == "hf":
        return _load_hf_hub(meta, repo_id)
    if scheme == "ms":
        found = find_modelscope_dir(repo_id, "datasets")
        if found is None:
            raise _not_cached(meta.id_or_path, f"ModelScope cache ({modelscope_cache_root()})",
                              f"`modelscope download --dataset {repo_id}`")
        return load_local(found, meta.subset_name, meta.split)
    path = Path(meta.id_or_path).expanduser()
    if not path.exists():
        raise ValueError(f"dataset {meta.id_or_path!r}: no such file or directory (hub "
                         "datasets are named hf://org/name or ms://org/name)")
    return load_local(path, meta.subset_name, meta.split)


def _not_cached(id_or_path: str, where: str, how: str) -> ValueError:
    return ValueError(
        f"dataset {id_or_path!r} is not in the local {where}, and twinkle_sdk does not "
        f"download. Download it first ({how}) or pass the path of a local file or directory.")


@contextlib.contextmanager
def _hub_offline() -> Iterator[None]:
    # `datasets` reads its offline flag from this module attribute at call time; setting it
    # (rather than HF_HUB_OFFLINE in the environment, read once at import) makes
    # load_dataset use only its local cache without changing the rest of the process.
    import datasets.config

    before = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = before


def _load_hf_hub(meta: DatasetMeta, repo_id: str) -> Any:
    from huggingface_hub import constants

    # 1. The repo's files in the hub cache (`hf download --repo-type dataset ...`).
    snapshot = hf_cache_dir(repo_id, repo_type="dataset")
    if snapshot is not None and _data_files(snapshot):
        return load_local(snapshot, meta.subset_name, meta.split)
    # 2. What an earlier online `datasets.load_dataset` left in the datasets cache.
    import datasets

    try:
        with _hub_offline():
            return datasets.load_dataset(repo_id, meta.subset_name, split=meta.split)
    except (ConnectionError, FileNotFoundError, ValueError) as e:
        raise _not_cached(meta.id_or_path, f"Hugging Face caches ({constants.HF_HUB_CACHE}, "
                          f"{datasets.config.HF_DATASETS_CACHE})",
                          f"`hf download --repo-type dataset {repo_id}`") from e


def _data_files(directory: Path) -> list[Path]:
    return sorted(
        p for p in directory.rglob("*")
        if p.suffix in FORMATS and p.name not in _METADATA_FILES and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(directory).parts))


def _split_of(path: Path, root: Path) -> str | None:
    """The split a data file belongs to by its name (train.jsonl, data/test-0000.parquet)."""
    parts = path.relative_to(root).parts
    for split in _SPLIT_NAMES:
        stem = path.name.split(".")[0]
        if split in parts[:-1] or stem == split or stem.startswith((f"{split}-", f"{split}_")):
            return split
    return None


def load_local(path: Path, subset_name: str | None = None, split: str = "train") -> Any:
    """Load a data file, or a directory of them (optionally split/subset by name)."""
    import datasets

    if path.is_file():
        return _load_files([path])
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        loaded = datasets.load_from_disk(str(path))  # written by save_to_disk
        return loaded[split] if isinstance(loaded, datasets.DatasetDict) else loaded
    root = path
    if subset_name and subset_name != "default":
        if not (path / subset_name).is_dir():
            subsets = sorted(p.name for p in path.iterdir() if p.is_dir() and _data_files(p))
            raise ValueError(f"dataset {str(path)!r} has no subset {subset_name!r}; "
                             f"subsets: {subsets or 'none'}")
        root = path / subset_name
    files = _data_files(root)
    if not files:
        raise ValueError(f"dataset {str(root)!r} holds no {'/'.join(FORMATS)} files")
    splits = {f: _split_of(f, root) for f in files}
    chosen = [f for f in files if splits[f] == split]
    if not chosen:
        found = sorted({s for s in splits.values() if s})
        if found or split != "train":
            raise ValueError(f"dataset {str(root)!r} has no split {split!r}; "
                             f"splits: {found or ['train (all files)']}")
        chosen = files  # files not named by split: together they are the train split
    return _load_files(chosen)


def _load_files(files: list[Path]) -> Any:
    import datasets

    for suffix, builder in FORMATS.items():
        of_format = [str(f) for f in files if f.suffix == suffix]
        if of_format:
            # .json and .jsonl both load with the json builder; keep them together.
            if builder == "json":
                of_format = [str(f) for f in files if FORMATS.get(f.suffix) == "json"]
            return datasets.load_dataset(builder, data_files=of_format, split="train")
    raise ValueError(f"unsupported data file {files[0]}; supported: {', '.join(FORMATS)}")
