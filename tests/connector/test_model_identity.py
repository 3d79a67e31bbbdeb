"""The weights fingerprint: the same checkpoint gives the same digest wherever it lives (two nodes
share KV through a deep tier), changed weights at the same path give another (no stale page is ever
found under the old keys), and the serving connector's page keys follow it."""

from __future__ import annotations

import os
import shutil
import time

import pytest

from flexflow_sglang.connector.model_identity import SAMPLE_BYTES, local_model_dir, weights_digest


def checkpoint(root, shards=2, size=3 * SAMPLE_BYTES + 123, seed=0):
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "config.json"), "w") as f:
        f.write('{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}')
    for i in range(shards):
        with open(os.path.join(root, f"model-{i:05d}-of-{shards:05d}.safetensors"), "wb") as f:
            f.write(bytes((seed + i + j) % 251 for j in range(256)) * (size // 256) + b"\0" * (size % 256))
    with open(os.path.join(root, "tokenizer.json"), "w") as f:
        f.write("{}")
    return str(root)


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_same_checkpoint_anywhere_same_digest_and_mtime_does_not_matter(tmp_path):
    a = checkpoint(tmp_path / "node-a" / "model")
    b = str(tmp_path / "node-b" / "copy")
    shutil.copytree(a, b)
    for name in os.listdir(b):
        os.utime(os.path.join(b, name), (time.time() - 3600, time.time() - 3600))
    da = weights_digest(a)
    assert da is not None and len(da) == 32
    assert weights_digest(b) == da
    # the tokenizer does not change the KV of given token ids
    with open(os.path.join(b, "tokenizer.json"), "w") as f:
        f.write('{"changed": true}')
    assert weights_digest(b) == da


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_weights_changed_in_place_change_the_digest(tmp_path, where):
    root = checkpoint(tmp_path / "m")
    before = weights_digest(root)
    shard = os.path.join(root, "model-00001-of-00002.safetensors")
    size = os.path.getsize(shard)
    flip_byte(shard, {"start": 10, "middle": size // 2, "end": size - 5}[where])
    assert weights_digest(root) != before


def test_config_shards_and_sizes_count(tmp_path):
    root = checkpoint(tmp_path / "m")
    before = weights_digest(root)
    with open(os.path.join(root, "config.json"), "a") as f:
        f.write(" ")
    after_config = weights_digest(root)
    assert after_config != before
    with open(os.path.join(root, "model-00000-of-00002.safetensors"), "ab") as f:
        f.write(b"\0")  # a size change outside every sampled window but the end's
    assert weights_digest(root) != after_config
    checkpoint(tmp_path / "nested" / "weights")  # shards one level down are found
    assert weights_digest(str(tmp_path / "nested")) is not None


def test_no_local_weights_no_digest(tmp_path):
    assert weights_digest(None) is None
    assert weights_digest(str(tmp_path / "missing")) is None
    assert local_model_dir("no-such-org/no-such-model-xyz") is None  # not cached: no network call
    empty = tmp_path / "dummy"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    assert weights_digest(str(empty)) is None  # dummy weights: path and revision only


def test_serving_keys_change_with_the_weights(tmp_path):
    """FlexFlowConnector.from_sglang (the serving path) puts the digest in its fingerprint: the
    same tokens get other page keys once the checkpoint at the same path changed."""
    pytest.importorskip("torch")
    pytest.importorskip("sglang.srt.mem_cache.memory_pool")
    from types import SimpleNamespace

    from flexflow_sglang.config import config_from_dict
    from flexflow_sglang.connector import FlexFlowConnector

    from test_connector_host_tier import mha

    root = checkpoint(tmp_path / "m")
    kv = mha(ps=1)
    cfg = config_from_dict({"topology": {"source": "mock", "mock": "single"}, "monitor": {"source": "mock"},
                            "host_tier": {"capacity_tokens": 16, "pin_memory": "never"}}, "<test>")
    alloc = SimpleNamespace(get_kvcache=lambda: kv)
    params = SimpleNamespace(token_to_kv_pool_allocator=alloc, page_size=1, pp_rank=0, pp_size=1,
                             attn_cp_rank=0, attn_cp_size=1)

    def keys():
        ctx = SimpleNamespace(server_args=SimpleNamespace(model_path=root, revision=None, quantization=None),
                              tp_rank=0, tp_size=1, tp_worker=None)
        c = FlexFlowConnector.from_sglang(params, ctx, config=cfg, tiers=[], start_agent=False)
        try:
            assert c._fingerprint["weights"] == weights_digest(root)
            return c.page_keys(list(range(8)))
        finally:
            c.close()
    k1 = keys()
    assert keys() == k1
    flip_byte(os.path.join(root, "model-00000-of-00002.safetensors"), 100)
    assert keys()[0] != k1[0]
