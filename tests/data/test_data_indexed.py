"""Indexed dataset files (.bin/.idx), GPT sample index over them, and blending."""

from __future__ import annotations

import multiprocessing
import pickle
import time

import numpy as np
import pytest
import torch

from megazoo.data.batches import GlobalBatchSampler
from megazoo.data.blending import BlendedDataset, blend_counts, blend_order
from megazoo.data.gpt_dataset import GPTDataset
from megazoo.data.indexed.dataset import HEADER, IndexedDataset, IndexedDatasetWriter, data_paths


def random_docs(seed: int, count: int, vocab: int = 1000, max_len: int = 50) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    # Include empty documents: the sample index must step over them.
    return [rng.integers(0, vocab, size=int(rng.integers(0, max_len))) for _ in range(count)]


def write(prefix, docs, vocab: int = 1000, **kwargs) -> IndexedDataset:
    with IndexedDatasetWriter(prefix, vocab, **kwargs) as writer:
        for doc in docs:
            writer.add_document(doc)
    return IndexedDataset(prefix)


@pytest.fixture
def corpus(tmp_path):
    docs = random_docs(0, 200)
    return write(tmp_path / "corpus", docs), docs


# ---------------------------------------------------------------------------------------------- files


def test_round_trip_and_dtypes(tmp_path, corpus):
    ds, docs = corpus
    assert len(ds) == len(docs) and ds.num_tokens == sum(map(len, docs))
    assert ds.dtype == np.uint16
    for i, doc in enumerate(docs):
        assert np.array_equal(ds.doc(i), doc)
    assert np.array_equal(ds.doc(5, offset=2, length=3), docs[5][2:5])
    ds.verify_data()
    reopened = pickle.loads(pickle.dumps(ds))  # pickles as its prefix, not its memory-mapped contents
    assert len(pickle.dumps(ds)) < 500 and np.array_equal(reopened.doc(7), docs[7])
    big = write(tmp_path / "big", [[0, 70000, 123]], vocab=100_000)  # ids beyond uint16
    assert big.dtype == np.uint32 and big.doc(0).tolist() == [0, 70000, 123]
    empty = write(tmp_path / "empty", [])
    assert len(empty) == 0 and empty.num_tokens == 0


def test_writer_rejects_out_of_vocab_ids_and_leaves_nothing(tmp_path):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        write(tmp_path / "bad", [[1, 2], [5, 1000]])
    assert list(tmp_path.iterdir()) == []  # no outputs, no temporary files


def test_existing_prefix_is_not_overwritten_unless_asked(tmp_path, corpus):
    ds, docs = corpus
    bin_path, idx_path = data_paths(ds.prefix)
    before = (bin_path.read_bytes(), idx_path.read_bytes())
    with pytest.raises(FileExistsError, match=str(bin_path)):
        IndexedDatasetWriter(ds.prefix, 1000)
    assert (bin_path.read_bytes(), idx_path.read_bytes()) == before
    replaced = write(ds.prefix, [[1, 2, 3]], overwrite=True)
    assert len(replaced) == 1 and replaced.doc(0).tolist() == [1, 2, 3]
    assert sorted(p.name for p in bin_path.parent.iterdir()) == ["corpus.bin", "corpus.idx"]


def test_missing_files_are_named(tmp_path, corpus):
    ds, _ = corpus
    with pytest.raises(FileNotFoundError, match="nowhere.idx"):
        IndexedDataset(tmp_path / "nowhere")
    data_paths(ds.prefix)[0].unlink()
    with pytest.raises(FileNotFoundError, match="corpus.bin"):
        IndexedDataset(ds.prefix)


def flip_byte(path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("position, message", [
    (0, "wrong magic"),
    (8, "format version"),
    (HEADER.size + 5, "checksum"),  # inside the document lengths
    (-1, "checksum"),  # inside the stored checksum itself
])
def test_corrupt_index_is_detected(corpus, position, message):
    ds, _ = corpus
    idx_path = data_paths(ds.prefix)[1]
    flip_byte(idx_path, position if position >= 0 else idx_path.stat().st_size + position)
    with pytest.raises(ValueError, match=message) as error:
        IndexedDataset(ds.prefix)
    assert str(idx_path) in str(error.value)


def test_truncated_files_are_detected(corpus):
    ds, _ = corpus
    bin_path, idx_path = data_paths(ds.prefix)
    bin_path.write_bytes(bin_path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="truncated") as error:
        IndexedDataset(ds.prefix)
    assert str(bin_path) in str(error.value)
    idx_path.write_bytes(idx_path.read_bytes()[:-10])
    with pytest.raises(ValueError, match=f"{idx_path}.*truncated"):
        IndexedDataset(ds.prefix)


def test_verify_data_catches_in_place_corruption(corpus):
    ds, _ = corpus
    flip_byte(data_paths(ds.prefix)[0], 10)
    with pytest.raises(ValueError, match="SHA-256"):
        IndexedDataset(ds.prefix).verify_data()


# ---------------------------------------------------------------------------------------------- GPT samples


def stream_of(gpt: GPTDataset) -> np.ndarray:
    return np.concatenate([gpt.indexed.doc(int(d)) for d in gpt.doc_idx])


def test_samples_cover_every_token_once_per_epoch(tmp_path, corpus):
    ds, docs = corpus
    gpt = GPTDataset(ds, seq_len=16, seed=3, num_epochs=3, cache_dir=tmp_path / "cache")
    # Each epoch is one permutation of all documents, so its tokens are the corpus exactly once.
    for epoch in range(3):
        assert sorted(gpt.doc_idx[epoch * len(ds):(epoch + 1) * len(ds)]) == list(range(len(ds)))
    # Stream samples tile the stream: rebuild it from their inputs plus the last target.
    samples = np.stack([gpt.stream_sample(s) for s in range(len(gpt))])
    rebuilt = np.concatenate([samples[:, :-1].reshape(-1), samples[-1, -1:]])
    stream = stream_of(gpt)
    assert len(gpt) == (3 * ds.num_tokens - 1) // 16
    assert len(stream) - len(rebuilt) < 16  # only the final partial sample is dropped
    assert np.array_equal(rebuilt, stream[:len(rebuilt)])
    # The dataset order is a permutation of the stream samples.
    assert sorted(gpt.shuffle_idx.tolist()) == list(range(len(gpt)))
    assert torch.equal(gpt.stack([0, 7]), torch.from_numpy(samples[gpt.shuffle_idx[[0, 7]]]))
    assert gpt[3].dtype == torch.long and gpt[3].shape == (17,)


def test_num_samples_keeps_whole_earlier_epochs(tmp_path, corpus):
    ds, _ = corpus
    seq = 16
    one_epoch = (ds.num_tokens - 1) // seq
    gpt = GPTDataset(ds, seq, seed=0, num_samples=one_epoch + 5, cache_dir=tmp_path)
    assert len(gpt) == one_epoch + 5 and gpt.num_epochs == 2
    # All samples lying wholly in epoch 1 are kept; the 5 extra come from the samples that reach epoch 2.
    assert set(range(one_epoch)) <= set(gpt.shuffle_idx.tolist())
    with pytest.raises(IndexError):
        gpt.stack([len(gpt)])


def test_seed_determinism_and_cache(tmp_path, corpus):
    ds, _ = corpus
    cache = tmp_path / "cache"
    first = GPTDataset(ds, 16, seed=1, num_epochs=2, cache_dir=cache)
    assert not first.loaded_from_cache and all(p.is_file() for p in first.cache_paths.values())
    again = GPTDataset(ds, 16, seed=1, num_epochs=2, cache_dir=cache)
    assert again.loaded_from_cache
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        assert np.array_equal(getattr(first, name), getattr(again, name))
    assert torch.equal(first.stack(range(20)), again.stack(range(20)))
    fresh = GPTDataset(ds, 16, seed=1, num_epochs=2, cache_dir=tmp_path / "elsewhere")  # rebuilt, same
    assert np.array_equal(fresh.shuffle_idx, first.shuffle_idx)
    other_seed = GPTDataset(ds, 16, seed=2, num_epochs=2, cache_dir=cache)
    assert not other_seed.loaded_from_cache
    assert not np.array_equal(other_seed.shuffle_idx, first.shuffle_idx)
    assert not np.array_equal(other_seed.doc_idx, first.doc_idx)
    longer = GPTDataset(ds, 32, seed=1, num_epochs=2, cache_dir=cache)  # seq_len change: a new index
    assert not longer.loaded_from_cache and longer.cache_paths != first.cache_paths
    assert len(list(cache.glob("*.npy"))) == 9 and not list(cache.glob(".*tmp"))
    default = GPTDataset(ds, 16, seed=1, num_epochs=2)  # no cache_dir: next to the data
    assert default.cache_paths["doc_idx"].parent == tmp_path


def _build_in_child(args) -> list:
    prefix, cache = args
    gpt = GPTDataset(IndexedDataset(prefix), 8, seed=5, num_epochs=4, cache_dir=cache)
    return gpt.shuffle_idx.tolist()


def test_concurrent_builders_agree(tmp_path, corpus):
    ds, _ = corpus
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map(_build_in_child, [(ds.prefix, tmp_path / "c")] * 4)
    assert all(r == results[0] for r in results)
    assert GPTDataset(ds, 8, seed=5, num_epochs=4, cache_dir=tmp_path / "c").loaded_from_cache


def test_index_build_is_fast_for_millions_of_tokens(tmp_path):
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 400, size=20_000)
    with IndexedDatasetWriter(tmp_path / "big", 50257) as writer:
        writer.add_documents(rng.integers(0, 50257, size=int(lengths.sum())), lengths)
    ds = IndexedDataset(tmp_path / "big")
    assert ds.num_tokens > 3_000_000
    start = time.perf_counter()
    gpt = GPTDataset(ds, 128, seed=0, num_epochs=5, cache_dir=tmp_path)
    assert time.perf_counter() - start < 5.0  # vectorised: well under a second when the machine is idle
    position, offset = gpt.sample_idx[-1]
    assert 0 <= offset < ds.lengths[gpt.doc_idx[position]]


def test_dp_ranks_read_disjoint_samples(tmp_path, corpus):
    ds, _ = corpus
    gpt = GPTDataset(ds, 16, seed=0, num_epochs=1, cache_dir=tmp_path)
    for step in range(3):
        whole = GlobalBatchSampler(len(gpt), 8, 8, 1, 0, 1, seed=7).indices_for_step(step)[0]
        per_rank = [sum(GlobalBatchSampler(len(gpt), 8, 2, 2, r, 2, seed=7).indices_for_step(step), [])
                    for r in range(2)]
        assert not set(per_rank[0]) & set(per_rank[1])
        assert per_rank[0] + per_rank[1] == whole
        assert torch.equal(torch.cat([gpt.stack(per_rank[0]), gpt.stack(per_rank[1])]), gpt.stack(whole))


# ---------------------------------------------------------------------------------------------- blending


@pytest.mark.parametrize("weights", [[0.5, 0.5], [0.7, 0.2, 0.1], [3, 1, 1, 0.01, 5], [1, 0, 2]])
def test_blend_proportions_are_exact_in_every_prefix(weights):
    size = 5000
    order = blend_order(weights, size)
    w = np.asarray(weights, dtype=float) / sum(weights)
    counts = np.cumsum(np.eye(len(w))[order], axis=0)
    lag = counts - np.arange(1, size + 1)[:, None] * w
    assert np.abs(lag).max() < 1
    assert np.all(np.abs(np.bincount(order, minlength=len(w)) - w * size) < 1)
    assert np.array_equal(order, blend_order(weights, size))
    assert blend_counts(weights, size) == np.bincount(order, minlength=len(w)).tolist()


def test_blended_dataset_reads_the_right_samples(tmp_path, corpus):
    ds, _ = corpus
    small = write(tmp_path / "small", random_docs(1, 10, max_len=30))
    a = GPTDataset(ds, 8, seed=0, num_epochs=1, cache_dir=tmp_path)
    b = GPTDataset(small, 8, seed=0, num_epochs=1, cache_dir=tmp_path)  # far shorter than its share: wraps
    size = 600
    blend = BlendedDataset([a, b], [0.6, 0.4], size, seed=1, cache_dir=tmp_path / "blend")
    assert blend.counts == blend_counts([0.6, 0.4], size) and abs(blend.counts[1] - 240) < 1
    assert not blend.loaded_from_cache
    rows = blend.stack(range(size))
    for j in (0, 1, 2, 3, 50, 599):
        source = (a, b)[int(blend.dataset_index[j])]
        assert torch.equal(rows[j], source[int(blend.dataset_sample_index[j])])
    # a's samples are taken in its own order; b wraps and each repeat pass is a permutation of b.
    assert blend.dataset_sample_index[blend.dataset_index == 0].tolist() == list(range(360))
    b_draws = blend.dataset_sample_index[blend.dataset_index == 1]
    passes = len(b_draws) // len(b)
    for p in range(passes):
        assert sorted(b_draws[p * len(b):(p + 1) * len(b)].tolist()) == list(range(len(b)))
    assert b_draws[len(b):2 * len(b)].tolist() != list(range(len(b)))
    again = BlendedDataset([a, b], [0.6, 0.4], size, seed=1, cache_dir=tmp_path / "blend")
    assert again.loaded_from_cache and torch.equal(again.stack(range(size)), rows)


def test_blending_rejects_bad_arguments(corpus):
    ds, _ = corpus
    gpt = GPTDataset(ds, 8, seed=0, num_epochs=1)
    with pytest.raises(ValueError, match="one weight per dataset"):
        BlendedDataset([gpt], [0.5, 0.5], 10, seed=0)
    with pytest.raises(ValueError, match="weights"):
        BlendedDataset([gpt, gpt], [1, -1], 10, seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        BlendedDataset([gpt, GPTDataset(ds, 4, seed=0, num_epochs=1)], [1, 1], 10, seed=0)
