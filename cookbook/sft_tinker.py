"""SFT self-cognition with the unmodified tinker client against a twinkled daemon (the seed
documents' Tinker-style script): twinkle_sdk prepares the data, tinker trains.

    twinkled serve --model <tiny dir> &        # see README
    python cookbook/sft_tinker.py --base-url http://127.0.0.1:8000 --api-key tml-... --model <tiny dir>
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tinker import types
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny import DATA, tiny_model  # noqa: E402

from twinkle_sdk import (  # noqa: E402
    DataLoader,
    Dataset,
    DatasetMeta,
    SelfCognitionProcessor,
    init_tinker_compat_client,
    input_feature_to_datum,
)
from twinkle_sdk.client import served_name  # noqa: E402


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--model", help="the daemon's model directory (default: tiny)")
    ap.add_argument("--epochs", type=int, default=5)
    args = ap.parse_args(argv)
    model_id = args.model or tiny_model()

    dataset = Dataset(DatasetMeta(str(DATA / "self_cognition.jsonl")))
    dataset.set_template("Template", model_id=model_id, max_length=128)
    dataset.map(SelfCognitionProcessor("twinkle Model", "twinkle Team"))
    dataset.encode(batched=True)
    dataloader = DataLoader(dataset=dataset, batch_size=8)

    service_client = init_tinker_compat_client(args.base_url, args.api_key)
    training_client = service_client.create_lora_training_client(
        base_model=served_name(model_id), rank=16).result()
    losses = []
    for epoch in range(args.epochs):
        for batch in tqdm(dataloader, desc=f"epoch {epoch}", disable=not sys.stderr.isatty()):
            data = [input_feature_to_datum(feature) for feature in batch]
            fwdbwd = training_client.forward_backward(data, "cross_entropy")
            optim = training_client.optim_step(types.AdamParams(learning_rate=1e-2))
            out = fwdbwd.result()
            optim.result()
            tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in data)
            losses.append(out.metrics["loss:sum"] / tokens)
        print(f"epoch {epoch}: mean token loss {losses[-1]:.3f}")
        print("saved", training_client.save_state(f"twinkle-lora-{epoch}").result().path)
    return losses


if __name__ == "__main__":
    main()
