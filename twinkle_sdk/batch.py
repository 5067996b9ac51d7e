"""Encoded rows -> the engine's token datums (shared by both backends)."""

from __future__ import annotations

from .template import IGNORE_INDEX as IGNORE  # a label that takes no loss (prompt, padding)


def unpack(rows: list[dict]) -> list[dict]:
    """A packed row (DataLoader(packing=True): several rows end to end, `position_ids`
    restarting at 0 for each) back into its rows. The engine pads and co-batches rows
    itself, and has no variable-length attention that would keep packed rows apart."""
    out = []
    for row in rows:
        pos = row.get("position_ids")
        if pos is None:
            out.append(row)
            continue
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        for a, b in zip(starts, starts[1:], strict=False):
            if b - a >= 2:
                out.append({"input_ids": row["input_ids"][a:b], "labels": row["labels"][a:b]})
    return out


def rows_to_datums(rows: list[dict], vision=None) -> tuple[list[dict], list[list[int]]]:
    """Each row's `input_ids` predicts itself shifted by one: tokens = ids[:-1], targets =
    ids[1:]. Returns the datums and, per datum, 1 where the target is labelled (not -100).
    A row's ImageChunks (images.py; `vision`: the model's) become their placeholder
    tokens, and the datum's `images` their checked images."""
    from .images import expand, has_images

    datums, masks = [], []
    for i, row in enumerate(unpack(rows)):
        ids, labels = row.get("input_ids"), row.get("labels")
        if ids is None or labels is None:
            raise ValueError(f"row {i} has no input_ids/labels: encode the dataset first "
                             "(dataset.set_template(...); dataset.encode())")
        if len(ids) != len(labels) or len(ids) < 2:
            raise ValueError(f"row {i}: {len(ids)} input_ids and {len(labels)} labels "
                             "(need equal lengths, at least 2)")
        images = []
        if has_images(ids):
            if not has_images(ids[-1:]):
                ids, labels, images = expand(ids, labels, vision)
            else:
                raise ValueError(f"row {i} ends with an image: nothing after it to predict")
        ids = [int(t) for t in ids]
        datums.append({"tokens": ids[:-1], "target_tokens": ids[1:]}
                      | ({"images": images} if images else {}))
        masks.append([0 if int(label) == IGNORE else 1 for label in labels[1:]])
    return datums, masks
