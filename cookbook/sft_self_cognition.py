"""SFT self-cognition, the seed documents' first loop, on the built-in tiny model.

    python cookbook/sft_self_cognition.py                      # the engine in this process
    python cookbook/sft_self_cognition.py --base-url http://127.0.0.1:8000 --api-key tml-...

The second form trains on a `twinkled` daemon; only the start-up line differs. Data
parallel in this process's mode, 2 ranks on a CPU (gloo) or 2 GPUs:

    torchrun --nproc_per_node=2 cookbook/sft_self_cognition.py --dp 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from peft import LoraConfig
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny import DATA, tiny_model  # noqa: E402

import twinkle_sdk as twinkle  # noqa: E402
from twinkle_sdk import (  # noqa: E402
    DataLoader,
    Dataset,
    DatasetMeta,
    MultiLoraTransformersModel,
    Sampler,
    SamplingParams,
    SelfCognitionProcessor,
    TransformersModel,
)

logger = twinkle.get_logger()


def main(argv: list[str] | None = None) -> list[float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model directory or hf:// / ms:// id (default: tiny)")
    ap.add_argument("--base-url", help="a twinkled daemon (default: train in this process)")
    ap.add_argument("--api-key")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--dp", type=int, default=1, help="data-parallel ranks (under torchrun)")
    ap.add_argument("--output-dir", default=None,
                    help="local checkpoints (default ~/.cache/twinkle/output)")
    args = ap.parse_args(argv)
    model_id = args.model or tiny_model()

    if args.base_url:  # the one line that changes: the engine is the daemon's
        twinkle.init_twinkle_client(args.base_url, args.api_key)
        Model = MultiLoraTransformersModel
    else:
        twinkle.initialize(mode="local",
                           global_device_mesh=twinkle.DeviceMesh.from_sizes(dp_size=args.dp))
        Model = TransformersModel

    dataset = Dataset(DatasetMeta(str(DATA / "self_cognition.jsonl")))
    dataset.set_template("Template", model_id=model_id, max_length=128)
    dataset.map(SelfCognitionProcessor("twinkle LLM", "ModelScope Community"))
    dataset.encode()
    dataloader = DataLoader(dataset=dataset, batch_size=4)

    model = Model(model_id=model_id, output_dir=args.output_dir)
    model.add_adapter_to_model("default", LoraConfig(r=8, lora_alpha=32,
                                                     target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=args.lr)
    model.set_lr_scheduler("CosineWarmupScheduler", num_warmup_steps=2,
                           num_training_steps=len(dataloader) * args.epochs)
    logger.info(model.get_train_configs())

    losses = []
    for epoch in range(args.epochs):
        for batch in tqdm(dataloader, desc=f"epoch {epoch}", disable=not sys.stderr.isatty()):
            output = model.forward_backward(inputs=batch)
            losses.append(output["loss"])
            model.clip_grad_and_step()
        logger.info(f"epoch {epoch}: {model.calculate_metric(is_training=True)}")
    path = model.save("last-checkpoint")
    logger.info(f"saved {path}")

    question = Dataset(DatasetMeta(str(DATA / "self_cognition.jsonl"), data_slice=range(1)))
    question.set_template("Template", model_id=model_id, max_length=128)
    question.map(SelfCognitionProcessor("twinkle LLM", "ModelScope Community"))
    question.encode(add_generation_prompt=True)
    reply = Sampler(model).sample([question[0]], SamplingParams(max_tokens=24, temperature=0.0))
    logger.info(f"Q: {question[0]['messages'][-1]['content']}  A: {reply[0].sequences[0].text}")
    return losses


if __name__ == "__main__":
    main()
