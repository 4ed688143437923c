"""``cute_fp4.hf.save_pretrained`` replaces, never mixes: a save over an earlier one leaves
exactly one checkpoint (the earlier one's shards, index or single file removed, files that
are not a checkpoint's weights kept); a save that fails midway leaves the earlier
checkpoint loadable and byte for byte as it was; ``from_pretrained`` refuses a directory
holding two checkpoints. On the CPU (tiny random Llama models)."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import hf_tiny  # noqa: E402
import safetensors.torch  # noqa: E402

import cute_fp4.hf as hf  # noqa: E402
from cute_fp4.errors import InputError  # noqa: E402
from cute_fp4.hf import checkpoint as ck  # noqa: E402
from cute_fp4.hf import save as save_mod  # noqa: E402

Q = "model.layers.0.self_attn.q_proj"
SHARDED = 100_000  # bytes: the tiny Llama in 4 shards
FOREIGN = ("README.md", "tokenizer.json", "notes.safetensors", "model-extra.safetensors")


@pytest.fixture(scope="module")
def models():
    """Two quantized tiny Llamas with different weights (seeds 0 and 1)."""
    out = []
    for seed in (0, 1):
        m = hf_tiny.build("llama", seed=seed)
        hf.quantize_model(m)
        out.append(m)
    return out


def _q_weight(model) -> torch.Tensor:
    return model.get_submodule(Q).weight.data


def _loads_as(path, model) -> None:
    loaded = hf.from_pretrained(path, device="cpu")
    assert torch.equal(_q_weight(loaded), _q_weight(model))


def _files(path) -> dict[str, str]:
    """name -> SHA-256 of every file in ``path`` (hidden ones included)."""
    return {n: hashlib.sha256((path / n).read_bytes()).hexdigest()
            for n in sorted(os.listdir(path)) if (path / n).is_file()}


def _weights(path) -> set[str]:
    return {n for n in os.listdir(path) if n.endswith((".safetensors", ".index.json"))
            and n not in FOREIGN}


@pytest.mark.parametrize("first,second", [(None, SHARDED), (SHARDED, None),
                                          (SHARDED, SHARDED // 2)])
def test_a_save_replaces_the_earlier_checkpoint(models, tmp_path, first, second):
    """single -> sharded (the issue's case: the old model.safetensors was loaded instead),
    sharded -> single (orphan shards), sharded -> sharded of another count; files that are
    not ours stay untouched."""
    a, b = models
    for name in FOREIGN:
        (tmp_path / name).write_text(f"not a checkpoint: {name}")
    kw = {} if first is None else {"max_shard_size": first}
    hf.save_pretrained(a, tmp_path, **kw)
    kw = {} if second is None else {"max_shard_size": second}
    files = hf.save_pretrained(b, tmp_path, **kw)
    index = [ck.INDEX_FILE] if len(files) > 1 else []
    assert _weights(tmp_path) == set(files + index)
    for name in FOREIGN:
        assert (tmp_path / name).read_text() == f"not a checkpoint: {name}"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".cute_fp4")]
    _loads_as(tmp_path, b)


def test_shards_an_old_index_names_are_removed(models, tmp_path):
    """A shard named otherwise (not model-0000N-of-0000M) is a weight file of the earlier
    save when its index names it."""
    a, b = models
    files = hf.save_pretrained(a, tmp_path, max_shard_size=SHARDED)
    text = (tmp_path / ck.INDEX_FILE).read_text()
    for i, f in enumerate(files):
        (tmp_path / f).rename(tmp_path / f"part{i}.safetensors")
        text = text.replace(f, f"part{i}.safetensors")
    (tmp_path / ck.INDEX_FILE).write_text(text)
    hf.save_pretrained(b, tmp_path)
    assert _weights(tmp_path) == {ck.SINGLE_FILE}


@pytest.mark.parametrize("fail_at", ["shard", "config"])
def test_a_failed_save_leaves_the_earlier_checkpoint(models, tmp_path, monkeypatch, fail_at):
    """A write that fails midway (the second shard, or config.json after every shard):
    the error comes through, the earlier checkpoint is byte for byte as it was and loads,
    and no staging folder is left."""
    a, b = models
    hf.save_pretrained(a, tmp_path, max_shard_size=SHARDED)
    before = _files(tmp_path)
    real, calls = safetensors.torch.save_file, []

    def save_file(tensors, filename, metadata=None):
        calls.append(filename)
        if fail_at == "shard" and len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(tensors, filename, metadata=metadata)

    def save_config(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    if fail_at == "config":
        monkeypatch.setattr(type(b.config), "save_pretrained", save_config)
    with pytest.raises(OSError, match="No space"):
        hf.save_pretrained(b, tmp_path, max_shard_size=SHARDED // 2)
    assert len(calls) == 2 if fail_at == "shard" else len(calls) > 2
    assert _files(tmp_path) == before
    assert sorted(os.listdir(tmp_path)) == list(before)
    monkeypatch.undo()
    _loads_as(tmp_path, a)


def test_an_interrupted_replacement_never_mixes(models, tmp_path, monkeypatch):
    """Killed while renaming (before the new index is in place): the directory holds no
    loadable checkpoint (a CheckpointError), never the old index over new shards."""
    a, b = models
    hf.save_pretrained(a, tmp_path, max_shard_size=SHARDED)
    real = os.replace

    def replace(src, dst):
        if os.path.basename(dst) == ck.INDEX_FILE:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(save_mod.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        hf.save_pretrained(b, tmp_path, max_shard_size=SHARDED)
    monkeypatch.undo()
    with pytest.raises(ck.CheckpointError, match="model.safetensors or "
                       "model.safetensors.index.json"):
        ck.read_tensor_index(tmp_path)


def test_from_pretrained_refuses_two_checkpoints(models, tmp_path):
    a, _ = models
    files = hf.save_pretrained(a, tmp_path, max_shard_size=SHARDED)
    (tmp_path / ck.SINGLE_FILE).write_bytes((tmp_path / files[0]).read_bytes())
    with pytest.raises(ck.CheckpointError) as e:
        hf.from_pretrained(tmp_path, device="cpu")
    assert ck.INDEX_FILE in str(e.value) and ck.SINGLE_FILE in str(e.value)


def test_a_path_that_is_a_file(models, tmp_path):
    a, _ = models
    (tmp_path / "ckpt").write_text("x")
    with pytest.raises(InputError, match="is an existing file"):
        hf.save_pretrained(a, tmp_path / "ckpt")
    with pytest.raises(InputError, match="cannot make the checkpoint directory"):
        hf.save_pretrained(a, tmp_path / "ckpt" / "sub")


def test_dead_staging_folders_are_removed(models, tmp_path):
    """The staging folder of a save whose process ended is removed; a live one stays."""
    a, _ = models
    dead = tmp_path / f"{save_mod._STAGE}{2**22 + 1}-x"  # above Linux's pid_max
    live = tmp_path / f"{save_mod._STAGE}{os.getpid()}-y"
    for d in (dead, live):
        d.mkdir()
        (d / ck.SINGLE_FILE).write_bytes(b"partial")
    hf.save_pretrained(a, tmp_path)
    assert not dead.exists() and live.exists()
