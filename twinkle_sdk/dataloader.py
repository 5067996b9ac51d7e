"""DataLoader: global batches of encoded rows, each rank taking its contiguous share.

`batch_size` is the GLOBAL batch size, as in the seed scripts: with 4 ranks and
batch_size=8 every rank gets 2 rows per step, and all ranks step through the same number of
batches (they must, since a step is collective). Batches are lists of row dicts, what
`model.forward_backward(inputs=batch)` and `input_feature_to_datum` take.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from typing import Any

Row = dict[str, Any]


def _dist_rank_world() -> tuple[int, int]:
    # Only look at torch.distributed if the program already imported torch: a group cannot be
    # initialised otherwise, and importing torch just to learn that costs seconds.
    torch = sys.modules.get("torch")
    if torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


class DataLoader:
    """Iterate `list[dict]` batches of `dataset` (a Dataset, any indexable of dicts, or a
    callable returning one).

    A global batch smaller than `min_batch_size` (or than `batch_size` with `drop_last`, or
    than the number of ranks, which could not all get a row) is dropped. `shuffle` orders rows
    by `seed` and the epoch, identically on every rank.

    `packing=True` concatenates consecutive rows (in iteration order, greedily) into
    sequences of at most `max_length` tokens (default: the dataset template's max_length);
    a packed row has `input_ids`, `labels` and `position_ids`, the latter restarting at 0 at
    each original row so the model side can keep rows from attending to each other. Rows
    longer than max_length are truncated. `batch_size` then counts packed sequences.
    """

    def __init__(self, dataset: Any, batch_size: int, min_batch_size: int | None = None,
                 packing: bool = False, shuffle: bool = False, seed: int = 0,
                 drop_last: bool = False, rank: int | None = None,
                 world_size: int | None = None, max_length: int | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, not {batch_size}")
        # The seed GRPO script passes a function that builds the dataset.
        if callable(dataset) and not hasattr(dataset, "__getitem__"):
            dataset = dataset()
        self.dataset = dataset
        self.batch_size = batch_size
        self.min_batch_size = min_batch_size or 1
        self.packing = packing
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        if (rank is None) != (world_size is None):
            raise ValueError("give both rank and world_size, or neither")
        self.rank, self.world_size = (rank, world_size) if rank is not None else _dist_rank_world()
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, {self.world_size})")
        self.max_length = max_length
        if packing:
            template = getattr(dataset, "template", None)
            self.max_length = max_length or getattr(template, "max_length", None)
            if not self.max_length:
                raise ValueError("packing needs max_length: pass it, or set a template with "
                                 "max_length on the dataset")
        self.epoch = 0
        self._lengths: list[int] | None = None

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration uses (it picks the shuffle order)."""
        self.epoch = epoch

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            # A str seed hashes deterministically (unlike hash()), so every rank and every run
            # agrees on the order of (seed, epoch).
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def _units(self, epoch: int) -> list[list[int]]:
        """What one batch slot holds: one row index, or several with packing."""
        order = self._order(epoch)
        if not self.packing:
            return [[i] for i in order]
        if self._lengths is None:
            # Streamed once and kept: packing plans need every row's length, not its tokens.
            self._lengths = [len(r["input_ids"]) for r in self.dataset]
        assert self.max_length is not None
        units: list[list[int]] = []
        current: list[int] = []
        used = 0
        for i in order:
            n = min(self._lengths[i], self.max_length)
            if current and used + n > self.max_length:
                units.append(current)
                current, used = [], 0
            current.append(i)
            used += n
        if current:
            units.append(current)
        return units

    def _global_batches(self, epoch: int) -> list[list[list[int]]]:
        units = self._units(epoch)
        need = max(self.min_batch_size, self.world_size,
                   self.batch_size if self.drop_last else 1)
        batches = [units[s:s + self.batch_size] for s in range(0, len(units), self.batch_size)]
        return [b for b in batches if len(b) >= need]

    def _share(self, batch: list[Any]) -> list[Any]:
        # Contiguous, as even as possible: the first len % world ranks get one extra.
        base, extra = divmod(len(batch), self.world_size)
        start = self.rank * base + min(self.rank, extra)
        return batch[start:start + base + (1 if self.rank < extra else 0)]

    def _fetch(self, indices: list[int]) -> list[Row]:
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None:
            return list(getitems(indices))
        return [self.dataset[i] for i in indices]

    def _pack(self, rows: list[Row]) -> Row:
        input_ids: list[int] = []
        labels: list[int] = []
        position_ids: list[int] = []
        for row in rows:
            if "labels" not in row:
                raise ValueError("packing needs encoded rows (input_ids and labels): call "
                                 "dataset.encode() first")
            assert self.max_length is not None
            n = min(len(row["input_ids"]), self.max_length)
            input_ids += list(row["input_ids"][:n])
            labels += list(row["labels"][:n])
            position_ids += list(range(n))
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}

    def __len__(self) -> int:
        return len(self._global_batches(self.epoch))

    def __iter__(self) -> Iterator[list[Row]]:
        epoch = self.epoch
        self.epoch += 1
        for batch in self._global_batches(epoch):
            mine = self._share(batch)
            if self.packing:
                yield [self._pack(self._fetch(unit)) for unit in mine]
            else:
                yield self._fetch([unit[0] for unit in mine])

