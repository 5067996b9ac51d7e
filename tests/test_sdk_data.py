"""twinkle_sdk's data side: Template, Preprocessors, Dataset, DataLoader, Datum (offline)."""

from __future__ import annotations

import json
import shutil

import pytest

from twinkle_sdk.dataloader import DataLoader
from twinkle_sdk.dataset import Dataset, DatasetMeta
from twinkle_sdk.datum import input_feature_to_datum
from twinkle_sdk.hub import resolve_model_dir
from twinkle_sdk.preprocessor import (
    AlpacaProcessor,
    GSM8KProcessor,
    MessagesProcessor,
    Preprocessor,
    SelfCognitionProcessor,
    get_preprocessor,
)
from twinkle_sdk.template import Template, get_template

CONVO = [
    {"role": "system", "content": "You are a model."},
    {"role": "user", "content": "hello there"},
    {"role": "assistant", "content": "Yes I can help."},
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "Four."},
]


@pytest.fixture(autouse=True)
def _private_caches(tmp_path, monkeypatch):
    """Point every hub/datasets cache at an empty temp dir: tests see only what they put there."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf-hub"))
    monkeypatch.setenv("MODELSCOPE_CACHE", str(tmp_path / "ms"))


@pytest.fixture(scope="module")
def nochat_dir(tiny_dir, tmp_path_factory):
    """The tiny tokenizer without a chat template: Template falls back to built-in ChatML."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("nochat")
    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    tok.chat_template = None
    tok.save_pretrained(str(out))
    return out


@pytest.fixture(params=["own", "fallback"])
def template(request, tiny_dir, nochat_dir):
    t = Template(tiny_dir if request.param == "own" else nochat_dir)
    assert t.uses_fallback == (request.param == "fallback")
    return t


def _labelled_runs(ids, labels):
    """Contiguous runs of labelled positions, as token lists; checks labels == ids there."""
    runs, current = [], []
    for tok, lab in zip(ids, labels, strict=True):
        if lab == -100:
            if current:
                runs.append(current)
            current = []
        else:
            assert lab == tok
            current.append(tok)
    return runs + ([current] if current else [])


# -- Template -----------------------------------------------------------------------------

def test_template_labels_only_the_assistant_turn(template):
    row = {"messages": CONVO[:3], "id": 7}
    enc = template.encode(row)
    ids, labels = enc["input_ids"], enc["labels"]
    assert len(ids) == len(labels) and enc["id"] == 7
    assert ids == template.tokenize(template.render(CONVO[:3]))
    runs = _labelled_runs(ids, labels)
    assert [template.decode(r) for r in runs] == ["Yes I can help.<|im_end|>"]
    # Everything before the run is exactly the prompt with its generation header.
    first = labels.index(next(lab for lab in labels if lab != -100))
    assert template.decode(ids[:first]) == template.render(CONVO[:2], add_generation_prompt=True)


def test_template_multi_turn_labels_both_assistant_turns(template):
    enc = template.encode({"messages": CONVO})
    runs = _labelled_runs(enc["input_ids"], enc["labels"])
    assert [template.decode(r) for r in runs] == ["Yes I can help.<|im_end|>", "Four.<|im_end|>"]
    unlabelled = [t for t, lab in zip(enc["input_ids"], enc["labels"], strict=True) if lab == -100]
    assert "what is two plus two" in template.decode(unlabelled)


def test_template_history_dependent_chat_template(tiny_dir):
    """A template that renders the last assistant turn differently (as Qwen3 does with
    <think>) still gets both turns labelled, each ending at its closing token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['role'] == 'assistant' and loop.last %}<think></think>{% endif %}"
        "{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    t = Template(tok)
    enc = t.encode({"messages": CONVO})
    runs = _labelled_runs(enc["input_ids"], enc["labels"])
    assert [t.decode(r) for r in runs] == ["Yes I can help.<|im_end|>",
                                           "<think></think>Four.<|im_end|>"]


def test_template_generation_prompt_is_an_unlabelled_prompt(template):
    row = {"messages": CONVO, "ground_truth": "4"}
    enc = template.encode(row, add_generation_prompt=True)
    assert enc["messages"] == CONVO[:4] and enc["ground_truth"] == "4"
    assert enc["input_ids"] == template.tokenize(template.render(CONVO[:4], True))
    assert template.decode(enc["input_ids"]).endswith("two plus two<|im_end|>\n<|im_start|>assistant\n")
    assert enc["labels"] == [-100] * len(enc["input_ids"])


def test_template_max_length_truncates_right(tiny_dir):
    full = Template(tiny_dir).encode({"messages": CONVO})
    short = Template(tiny_dir, max_length=30).encode({"messages": CONVO})
    assert len(full["input_ids"]) > 30
    assert short["input_ids"] == full["input_ids"][:30]
    assert short["labels"] == full["labels"][:30]


def test_template_registry_and_errors(tiny_dir):
    t = get_template("Qwen3_5Template", model_id=str(tiny_dir), max_length=12)
    assert isinstance(t, Template) and t.max_length == 12
    with pytest.raises(ValueError, match="unknown template 'Nope'.*Llama3Template.*Template"):
        get_template("Nope", model_id=str(tiny_dir))
    with pytest.raises(ValueError, match="no 'messages'"):
        t.encode({"query": "q"})


# -- hub ids --------------------------------------------------------------------------------

def _fake_hf_snapshot(tmp_path, repo_type, repo_id):
    import huggingface_hub.constants

    org, name = repo_id.split("/")
    base = tmp_path / "hf-hub" / f"{repo_type}s--{org}--{name}"
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text("abc123")
    snap = base / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    assert huggingface_hub.constants.HF_HUB_CACHE == str(tmp_path / "hf-hub")
    return snap


def test_resolve_model_dir(tiny_dir, tmp_path):
    assert resolve_model_dir(str(tiny_dir)) == tiny_dir
    snap = _fake_hf_snapshot(tmp_path, "model", "org/hfmodel")
    assert resolve_model_dir("hf://org/hfmodel") == snap
    ms = tmp_path / "ms" / "models" / "Qwen" / "Qwen3___5-4B"
    shutil.copytree(tiny_dir, ms)
    assert resolve_model_dir("ms://Qwen/Qwen3.5-4B") == ms
    # The template reaches the tokenizer through the ModelScope cache.
    assert Template("ms://Qwen/Qwen3.5-4B").encode({"messages": CONVO[:3]})["input_ids"]
    for missing in ("hf://org/missing", "ms://org/missing", "org/missing"):
        with pytest.raises(ValueError, match=f"'{missing}' is .*in the local .*does not download"):
            resolve_model_dir(missing)
    with pytest.raises(ValueError, match="no such directory"):
        resolve_model_dir(str(tmp_path / "nowhere"))


# -- Preprocessors ----------------------------------------------------------------------------

def test_self_cognition_processor():
    p = SelfCognitionProcessor(("小闪", "Twinkle"), "ModelScope", system="Be brief.")
    out = p({"query": "who are you?", "response": "I am {{NAME}}, made by {{AUTHOR}}.",
             "tag": "en"})
    assert out == {"messages": [{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "who are you?"},
                                {"role": "assistant", "content": "I am Twinkle, made by ModelScope."}]}
    zh = p({"query": "你是谁", "response": "我是{{NAME}}", "tag": "zh"})
    assert zh["messages"][-1]["content"] == "我是小闪"


def test_gsm8k_processor_keeps_ground_truth():
    p = GSM8KProcessor()
    out = p({"question": "Tom has 3 apples...", "answer": "3*412=1236 <<3*412=1236>>\n#### 1,236"})
    roles = [m["role"] for m in out["messages"]]
    assert roles == ["system", "user", "assistant"] and "####" in out["messages"][0]["content"]
    assert out["messages"][1]["content"] == "Tom has 3 apples..."
    assert out["ground_truth"] == "1236"
    assert p({"question": "q", "answer": "owes #### -5"})["ground_truth"] == "-5"
    assert p({"question": "q", "answer": "no final answer"}) is None


def test_messages_and_alpaca_processors():
    sharegpt = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}],
                "system": "sys", "source": "x"}
    assert MessagesProcessor()(sharegpt) == {
        "source": "x", "messages": [{"role": "system", "content": "sys"},
                                    {"role": "user", "content": "hi"},
                                    {"role": "assistant", "content": "yo"}]}
    with pytest.raises(ValueError, match="unknown role 'narrator'"):
        MessagesProcessor()({"messages": [{"role": "narrator", "content": "x"}]})
    assert MessagesProcessor()({"messages": []}) is None
    out = AlpacaProcessor()({"instruction": "Add", "input": "2 and 3", "output": "5"})
    assert out["messages"] == [{"role": "user", "content": "Add\n\n2 and 3"},
                               {"role": "assistant", "content": "5"}]


def test_get_preprocessor_by_name_class_instance():
    p = get_preprocessor("SelfCognitionProcessor", {"model_name": "N", "model_author": "A"})
    assert isinstance(p, SelfCognitionProcessor) and p.model_name == ("N", "N")
    assert isinstance(get_preprocessor(GSM8KProcessor), GSM8KProcessor)
    inst = AlpacaProcessor()
    assert get_preprocessor(inst) is inst
    with pytest.raises(ValueError, match="init_args"):
        get_preprocessor(inst, {"system": "x"})
    with pytest.raises(ValueError, match="unknown preprocessor 'Nope'.*AlpacaProcessor.*GSM8KProcessor"):
        get_preprocessor("Nope")

    class UpperProcessor(Preprocessor):
        def __call__(self, row):
            return {"messages": [{"role": "user", "content": row["t"].upper()}]}

    assert isinstance(get_preprocessor("UpperProcessor"), UpperProcessor)


# -- Dataset ------------------------------------------------------------------------------------

ALPACA = [{"instruction": f"say {i}", "input": "", "output": f"number {i}"} for i in range(10)]


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        import pandas as pd

        df = pd.DataFrame(rows)
        df.to_csv(path, index=False) if path.suffix == ".csv" else df.to_parquet(path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".csv", ".parquet"])
def test_dataset_from_local_file(tmp_path, tiny_dir, suffix):
    path = _write(tmp_path / f"data{suffix}", ALPACA)
    ds = Dataset(DatasetMeta(str(path)))
    assert len(ds) == 10 and ds[3]["instruction"] == "say 3"
    ds.set_template("Template", model_id=str(tiny_dir))
    ds.map(AlpacaProcessor(), load_from_cache_file=False).encode(batched=True)
    row = ds[3]
    runs = _labelled_runs(row["input_ids"], row["labels"])
    assert [ds.template.decode(r) for r in runs] == ["number 3<|im_end|>"]
    assert [r["messages"][0]["content"] for r in ds] == [f"say {i}" for i in range(10)]


def test_dataset_directory_splits_subsets_and_slices(tmp_path):
    _write(tmp_path / "d" / "train.jsonl", ALPACA)
    _write(tmp_path / "d" / "test.jsonl", ALPACA[:2])
    assert len(Dataset(DatasetMeta(str(tmp_path / "d")))) == 10
    assert len(Dataset(DatasetMeta(str(tmp_path / "d"), split="test"))) == 2
    with pytest.raises(ValueError, match="no split 'validation'.*test.*train"):
        Dataset(DatasetMeta(str(tmp_path / "d"), split="validation"))
    sliced = Dataset(DatasetMeta(str(tmp_path / "d"), data_slice=range(2, 100)))
    assert [r["instruction"] for r in sliced] == [f"say {i}" for i in range(2, 10)]
    picked = Dataset(DatasetMeta(str(tmp_path / "d"), data_slice=[5, 1, -1]))
    assert [r["instruction"] for r in picked] == ["say 5", "say 1", "say 9"]
    assert len(Dataset(DatasetMeta(str(tmp_path / "d"), data_slice=slice(0, 10, 3)))) == 4
    # Sub-directories are subsets (GSM8K's "main"); files in them may be split by name.
    _write(tmp_path / "g" / "main" / "test-00000-of-00001.parquet", ALPACA[:3])
    _write(tmp_path / "g" / "main" / "train-00000-of-00001.parquet", ALPACA)
    assert len(Dataset(DatasetMeta(str(tmp_path / "g"), subset_name="main", split="test"))) == 3
    with pytest.raises(ValueError, match="no subset 'socratic'.*main"):
        Dataset(DatasetMeta(str(tmp_path / "g"), subset_name="socratic"))


def test_dataset_unknown_ids_say_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="nowhere.jsonl'.*no such file"):
        Dataset(DatasetMeta(str(tmp_path / "nowhere.jsonl")))
    for missing in ("hf://org/missing", "ms://swift/self-cognition"):
        with pytest.raises(ValueError, match=f"'{missing}' is not in the local .*download"):
            Dataset(DatasetMeta(missing))


def test_dataset_seed_flow_from_hub_caches(tmp_path, tiny_dir):
    """The seed scripts' calls, with ms:// and hf:// datasets present in the local caches."""
    rows = [{"query": "who are you?", "response": "I am {{NAME}} by {{AUTHOR}}.", "tag": "en"}] * 3
    _write(tmp_path / "ms" / "datasets" / "swift" / "self-cognition" / "self_cognition.jsonl", rows)
    ds = Dataset(dataset_meta=DatasetMeta("ms://swift/self-cognition", data_slice=range(500)))
    ds.set_template("Qwen3_5Template", model_id=str(tiny_dir), max_length=256)
    ds.map("SelfCognitionProcessor", init_args={"model_name": "twinkle", "model_author": "MS"})
    ds.encode(batched=True, load_from_cache_file=False)
    assert len(ds) == 3
    runs = _labelled_runs(ds[0]["input_ids"], ds[0]["labels"])
    assert [ds.template.decode(r) for r in runs] == ["I am twinkle by MS.<|im_end|>"]

    snap = _fake_hf_snapshot(tmp_path, "dataset", "openai/gsm8k")
    gsm = [{"question": "1+1?", "answer": "1+1=2\n#### 2"}, {"question": "bad", "answer": "x"},
           {"question": "2+3?", "answer": "#### 5"}]
    _write(snap / "main" / "train-00000-of-00001.parquet", gsm)
    ds = Dataset(DatasetMeta("hf://openai/gsm8k", subset_name="main", split="train"))
    ds.set_template("Template", model_id=str(tiny_dir), max_length=2048)
    ds.map(GSM8KProcessor()).encode(add_generation_prompt=True)
    assert len(ds) == 2  # the row with no '####' answer is dropped
    assert [r["ground_truth"] for r in ds] == ["2", "5"]
    assert all(set(r["labels"]) == {-100} for r in ds)
    assert [m["role"] for m in ds[0]["messages"]] == ["system", "user"]


def test_dataset_encode_needs_template(tmp_path):
    ds = Dataset(str(_write(tmp_path / "a.jsonl", ALPACA)))
    with pytest.raises(ValueError, match="set_template"):
        ds.encode()


# -- DataLoader -----------------------------------------------------------------------------------

ROWS = [{"i": i, "input_ids": list(range(100 + i, 100 + i + 3 + i % 4)),
         "labels": [-100] + list(range(101 + i, 100 + i + 3 + i % 4))} for i in range(10)]


def _ids(batches):
    return [[r["i"] for r in b] for b in batches]


def test_dataloader_batches_and_min_batch_size():
    dl = DataLoader(ROWS, batch_size=4)
    assert len(dl) == 3 and _ids(dl) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert _ids(DataLoader(ROWS, batch_size=4, min_batch_size=4)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert len(DataLoader(ROWS, batch_size=4, drop_last=True)) == 2
    assert _ids(DataLoader(lambda: ROWS[:5], batch_size=2)) == [[0, 1], [2, 3], [4]]


def test_dataloader_rank_shards_each_global_batch():
    shards = [_ids(DataLoader(ROWS, batch_size=5, rank=r, world_size=2)) for r in range(2)]
    assert shards == [[[0, 1, 2], [5, 6, 7]], [[3, 4], [8, 9]]]
    # A last global batch of 1 row cannot feed 3 ranks: every rank drops it.
    per_rank = [DataLoader(ROWS, batch_size=3, rank=r, world_size=3) for r in range(3)]
    assert [len(d) for d in per_rank] == [3, 3, 3]
    assert _ids(per_rank[2]) == [[2], [5], [8]]
    with pytest.raises(ValueError, match="rank 2"):
        DataLoader(ROWS, batch_size=2, rank=2, world_size=2)


def test_dataloader_shuffle_is_seeded_per_epoch():
    a = DataLoader(ROWS, batch_size=10, shuffle=True, seed=1)
    b = DataLoader(ROWS, batch_size=10, shuffle=True, seed=1)
    first_a, first_b = _ids(a), _ids(b)
    assert first_a == first_b and sorted(first_a[0]) == list(range(10))
    assert first_a[0] != list(range(10))
    assert _ids(a) != first_a  # the next epoch has another order
    halves = [_ids(DataLoader(ROWS, batch_size=10, shuffle=True, seed=1, rank=r, world_size=2))
              for r in range(2)]
    assert halves[0][0] + halves[1][0] == first_a[0]


def test_dataloader_packing():
    dl = DataLoader(ROWS, batch_size=2, packing=True, max_length=12)
    batches = list(dl)
    packed = [row for b in batches for row in b]
    assert len(dl) == len(batches) and all(len(b) <= 2 for b in batches)
    assert all(len(p["input_ids"]) <= 12 for p in packed)
    # All tokens kept in order; position_ids restart at each original row.
    assert sum((p["input_ids"] for p in packed), []) == sum((r["input_ids"] for r in ROWS), [])
    assert sum((p["labels"] for p in packed), []) == sum((r["labels"] for r in ROWS), [])
    expected_pos = sum((list(range(len(r["input_ids"]))) for r in ROWS), [])
    assert sum((p["position_ids"] for p in packed), []) == expected_pos
    # Rows have 3,4,5,6,3,4,5,6,3,4 tokens: greedy fill up to 12.
    assert [len(p["input_ids"]) for p in packed] == [12, 9, 9, 9, 4]
    assert packed[0]["position_ids"] == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="max_length"):
        DataLoader(ROWS, batch_size=2, packing=True)


def test_dataloader_over_dataset_uses_template_max_length(tmp_path, tiny_dir):
    ds = Dataset(str(_write(tmp_path / "a.jsonl", ALPACA)))
    ds.set_template("Template", model_id=str(tiny_dir), max_length=64)
    ds.map("AlpacaProcessor").encode()
    plain = list(DataLoader(ds, batch_size=4))
    assert [len(b) for b in plain] == [4, 4, 2]
    assert plain[0][1]["input_ids"] == ds[1]["input_ids"]
    packed = [r for b in DataLoader(ds, batch_size=8, packing=True) for r in b]
    assert all(len(p["input_ids"]) <= 64 for p in packed)
    assert len(packed) < len(ds)


# -- Datum --------------------------------------------------------------------------------------------

def test_input_feature_to_datum():
    feature = {"input_ids": [5, 6, 7, 8, 9], "labels": [-100, -100, 7, 8, 9], "x": 1}
    datum = input_feature_to_datum(feature)
    assert datum.model_input.to_ints() == [5, 6, 7, 8]
    assert datum.loss_fn_inputs["target_tokens"].tolist() == [6, 7, 8, 9]
    assert datum.loss_fn_inputs["weights"].tolist() == [0.0, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="labels has 2"):
        input_feature_to_datum({"input_ids": [1, 2, 3], "labels": [1, 2]})
