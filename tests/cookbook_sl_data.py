"""tests/test_cookbook_sl.py's dataset: the cookbook's supervised types, imported by the test
when it runs (the cookbook's `supervised` package imports `datasets`, ~1 s of CPU in every
test process that collects the file, where one runs it)."""

from __future__ import annotations

import chz
import tinker
import torch
from tinker_cookbook import tokenizer_utils
from tinker_cookbook.supervised.common import datum_from_model_input_weights
from tinker_cookbook.supervised.types import SupervisedDataset, SupervisedDatasetBuilder

LINES = ["the sun and the sea are big.", "hello world from twinkle, yes.",
         "a tiny model learns these lines.", "twinkle trains many adapters at once."]


class Lines(SupervisedDataset):
    """Every line a datum, weights on all of it; one batch of all lines per step."""

    def __init__(self, model_name: str):
        tok = tokenizer_utils.get_tokenizer(model_name)
        self.data = [datum_from_model_input_weights(
            tinker.ModelInput.from_ints(ids), torch.ones(len(ids)))
            for ids in (tok(line).input_ids for line in LINES)]

    def get_batch(self, index: int) -> list:
        return self.data

    def __len__(self) -> int:
        return 1

    def set_epoch(self, seed: int = 0) -> None:
        pass


@chz.chz
class LinesBuilder(SupervisedDatasetBuilder):
    model_name: str

    def __call__(self):
        return Lines(self.model_name), None
