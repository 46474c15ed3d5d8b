"""Delta weight sync: subscribers rebuild the published weights bit for bit, from the objects
(in process, Ray) and from their bytes (HTTP); malformed bytes are a ValueError naming the fault;
the background publisher sends the bytes of the weights as they were when submitted."""
import dataclasses
import json
import threading
import zlib

import numpy as np
import pytest
import torch

from megatron_composer.inference.weight_sync import (
    BackgroundPublisher,
    StaleBaseError,
    TensorPayload,
    WeightPublisher,
    WeightSubscriber,
    decode_update,
    encode_update,
    unchanged_fraction,
)


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"embedding.weight": torch.randn(64, 32, generator=g), "layer.bias": torch.randn(32, generator=g),
            "steps": torch.tensor([3, 4], dtype=torch.int64)}


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32) if t.dtype == torch.float32 else t


def _same_bits(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(_bits(a[name]), _bits(b[name])), name


def test_a_chain_of_deltas_rebuilds_every_version_bit_for_bit():
    w = _weights()
    pub, sub = WeightPublisher(torch.bfloat16), WeightSubscriber()
    g = torch.Generator().manual_seed(1)
    for version in range(5):
        update = pub.publish(w, version)
        assert update.is_delta == (version > 0)
        got = sub.apply(update)
        expected = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in w.items()}
        _same_bits(got, expected)
        assert sub.version == version
        # an optimizer-sized step: most bf16 values do not move
        w = {n: (t + 1e-4 * torch.randn(t.shape, generator=g) if t.is_floating_point() else t + 1) for n, t in w.items()}


def test_a_delta_of_a_small_step_is_much_smaller_than_the_full_upload():
    w = _weights()
    pub = WeightPublisher(torch.bfloat16)
    full = pub.publish(w, 0)
    moved = dict(w, **{"layer.bias": w["layer.bias"].clone()})
    moved["embedding.weight"] = w["embedding.weight"].clone()
    moved["embedding.weight"][0, :4] += 1.0  # 4 of 2048 elements change
    delta = pub.publish(moved, 1)
    assert full.raw_bytes == 64 * 32 * 2 + 32 * 2 + 2 * 8
    assert delta.sent_bytes < full.sent_bytes / 10
    assert unchanged_fraction({"w": w["embedding.weight"].bfloat16()}, {"w": moved["embedding.weight"].bfloat16()}) \
        == pytest.approx(1 - 4 / 2048)


def test_special_values_survive_as_bit_patterns():
    w = {"w": torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1e-40, -3.5])}
    pub, sub = WeightPublisher(None), WeightSubscriber()
    sub.apply(pub.publish(w, 0))
    w2 = {"w": torch.tensor([-0.0, 0.0, float("-inf"), float("nan"), 2e-40, -3.5])}
    got = sub.apply(pub.publish(w2, 1))
    assert torch.equal(got["w"].view(torch.int32), w2["w"].view(torch.int32))


def test_a_delta_on_the_wrong_base_is_refused_and_a_snapshot_recovers():
    pub = WeightPublisher(torch.bfloat16)
    sub = WeightSubscriber()
    pub.publish(_weights(0), 0)
    delta = pub.publish(_weights(1), 1)
    with pytest.raises(ValueError, match="from version 0 cannot apply to version None"):
        sub.apply(delta)  # a restarted worker with no copy
    assert sub.version is None and sub.state == {}
    got = sub.apply(pub.snapshot())
    _same_bits(got, {n: t.bfloat16() if t.is_floating_point() else t for n, t in _weights(1).items()})
    with pytest.raises(ValueError, match="nothing was published"):
        WeightPublisher().snapshot()


def test_a_corrupt_payload_is_a_clear_error_and_changes_nothing():
    pub, sub = WeightPublisher(torch.bfloat16), WeightSubscriber()
    sub.apply(pub.publish(_weights(0), 0))
    before = {n: t.clone() for n, t in sub.state.items()}
    delta = pub.publish(_weights(1), 1)
    delta.tensors["layer.bias"].data = b"not zlib"
    with pytest.raises(ValueError, match="layer.bias of weights version 1 is corrupt"):
        sub.apply(delta)
    _same_bits(sub.state, before)
    assert sub.version == 0


def test_a_changed_layout_gets_a_full_update():
    pub = WeightPublisher(torch.bfloat16)
    pub.publish(_weights(0), 0)
    bigger = dict(_weights(0), extra=torch.ones(3))
    assert not pub.publish(bigger, 1).is_delta
    assert pub.publish(bigger, 2).is_delta


def test_bool_and_byte_tensors_round_trip():
    w = {"mask": torch.tensor([True, False, True]), "codes": torch.tensor([1, 255, 7], dtype=torch.uint8)}
    pub, sub = WeightPublisher(), WeightSubscriber()
    sub.apply(pub.publish(w, 0))
    w2 = {"mask": torch.tensor([False, False, True]), "codes": torch.tensor([1, 0, 9], dtype=torch.uint8)}
    got = sub.apply(pub.publish(w2, 1))
    assert torch.equal(got["mask"], w2["mask"]) and torch.equal(got["codes"], w2["codes"])


# ---------------------------------------------------------------- bytes (the HTTP transport)

def test_updates_through_their_bytes_rebuild_every_version_bit_for_bit():
    """Full, then deltas, each through encode_update/decode_update; an empty tensor and an integer
    tensor included; the reference is torch's own bf16 cast."""
    w = dict(_weights(), empty=torch.zeros(0, 3))
    pub, sub = WeightPublisher(torch.bfloat16), WeightSubscriber()
    for version in range(3):
        update = pub.publish(w, version)
        decoded = decode_update(encode_update(update))
        assert (decoded.version, decoded.base_version) == (version, None if version == 0 else version - 1)
        got = sub.apply(decoded)
        _same_bits(got, {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in w.items()})
        w = {n: t * 1.5 if t.is_floating_point() else t + 1 for n, t in w.items()}


def _with_metadata(update, change) -> bytes:
    """encode_update's bytes with the metadata JSON edited by `change` (the payloads untouched)."""
    from safetensors.torch import load, save

    data = encode_update(update)
    length = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8:8 + length])["__metadata__"]
    header = json.loads(metadata["update"])
    change(header)
    return save(load(data), metadata=dict(metadata, update=json.dumps(header)))


def _malformed():
    update = WeightPublisher(torch.bfloat16).publish(_weights(), 0)
    data = encode_update(update)
    from safetensors.torch import save

    def set_(key, value):
        return lambda h: h.__setitem__(key, value)

    def spec(name, value):
        return lambda h: h["tensors"].__setitem__(name, value)

    return [
        ("empty", b"", "not a weight update"),
        ("not safetensors", b"GET / HTTP/1.1\r\n\r\n", "not a weight update"),
        ("truncated in the header", data[:40], "not a weight update"),
        ("truncated in the payloads", data[:-5], "not a weight update"),
        ("a plain safetensors file", save({"w": torch.ones(2)}), "format"),
        ("negative version", _with_metadata(update, set_("version", -1)), "version must be an integer >= 0"),
        ("a tensor not listed", _with_metadata(update, lambda h: h["tensors"].pop("steps")), "lists tensors"),
        ("unknown dtype", _with_metadata(update, spec("steps", ["complex64", [2]])), "dtype of"),
        ("negative shape", _with_metadata(update, spec("steps", ["int64", [-2]])), "shape must be an integer"),
        ("not json", _with_metadata(update, lambda h: h.clear()), "malformed"),
    ]


MALFORMED = _malformed()


@pytest.mark.parametrize("data, message", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_bytes_are_a_value_error_naming_the_fault(data, message):
    with pytest.raises(ValueError, match=message):
        decode_update(data)


@pytest.mark.parametrize("shape, payload", [
    ((64, 32), zlib.compress(b"\0" * 100)),        # too short for its shape
    ((4,), zlib.compress(b"\0" * 100)),            # too long: inflating stops at the shape's size
    ((1 << 40,), zlib.compress(b"\0" * 1000)),     # a bomb: refused before inflating
    ((32,), zlib.compress(b"\0" * 64) + b"tail"),  # bytes after the stream
])
def test_a_payload_that_does_not_fit_its_shape_changes_nothing(shape, payload):
    pub, sub = WeightPublisher(torch.bfloat16), WeightSubscriber()
    sub.apply(pub.publish(_weights(), 0))
    before = {n: t.clone() for n, t in sub.state.items()}
    full = pub.snapshot()
    bad = dataclasses.replace(full, version=1, tensors=dict(full.tensors, **{
        "layer.bias": TensorPayload(torch.bfloat16, shape, payload)}))
    with pytest.raises(ValueError, match="layer.bias of weights version 1 is corrupt"):
        sub.apply(decode_update(encode_update(bad)))
    _same_bits(sub.state, before)
    assert sub.version == 0


def test_rebuild_does_not_commit_and_a_stale_delta_is_a_stale_base_error():
    pub, sub = WeightPublisher(torch.bfloat16), WeightSubscriber()
    first = pub.publish(_weights(0), 0)
    rebuilt = sub.rebuild(first)
    assert sub.version is None and sub.state == {}
    sub.commit(first, rebuilt)
    pub.publish(_weights(1), 1)
    with pytest.raises(StaleBaseError, match="a delta from version 1 cannot apply to version 0"):
        sub.apply(pub.publish(_weights(2), 2))
    sub.reset()
    assert sub.version is None and sub.apply(pub.snapshot()) and sub.version == 2


# ---------------------------------------------------------------- encoding off the training step

def _reference_payload(value, base=None) -> bytes:
    """One tensor's wire bytes computed here with numpy: the bf16 (floating) or raw bit patterns, XORed
    with the base's for a delta, as byte planes (byte 0 of every element, then byte 1, ...), zlib level 1."""
    def bits(t):
        return t.to(torch.bfloat16).view(torch.int16).numpy() if t.is_floating_point() else t.numpy()

    b = bits(value).reshape(-1)
    if base is not None:
        b = np.bitwise_xor(b, bits(base).reshape(-1))
    return zlib.compress(np.ascontiguousarray(b.view(np.uint8).reshape(-1, b.itemsize).T).tobytes(), 1)


def test_the_background_publisher_sends_the_formats_bytes_of_the_weights_at_submit():
    """Each update equals the reference encoding of the weights as they were when submitted, though the
    caller changes them in place as soon as submit returns (the next step), and equals publish()'s update."""
    w, g = _weights(0), torch.Generator().manual_seed(3)
    background, inline = BackgroundPublisher(WeightPublisher(torch.bfloat16)), WeightPublisher(torch.bfloat16)
    before = None
    try:
        for version in range(4):
            sent = {n: t.clone() for n, t in w.items()}
            background.submit(w, version)
            for t in w.values():  # the next step moves the weights at once
                t.add_(torch.randn(t.shape, generator=g) if t.is_floating_point() else 1)
            update = background.result(version, timeout=60)
            assert (update.version, update.base_version) == (version, None if before is None else version - 1)
            for name, payload in update.tensors.items():
                assert payload.data == _reference_payload(sent[name], None if before is None else before[name]), name
            same = inline.publish(sent, version)
            assert (same.version, same.base_version, same.raw_bytes, same.tensors) == \
                (update.version, update.base_version, update.raw_bytes, update.tensors)
            before = sent
        assert background.snapshot().tensors == inline.snapshot().tensors
    finally:
        background.close()


def test_a_step_that_outpaces_the_encoder_waits_with_one_copy_queued():
    gate, encoding = threading.Event(), threading.Event()
    inner = WeightPublisher(torch.bfloat16)
    encode = inner.encode

    def slow_encode(*args, **kwargs):
        encoding.set()
        assert gate.wait(30)
        return encode(*args, **kwargs)

    inner.encode = slow_encode
    background = BackgroundPublisher(inner)
    try:
        background.submit(_weights(0), 0)
        assert encoding.wait(30)  # version 0 is being encoded
        background.submit(_weights(1), 1)  # queued
        third = threading.Thread(target=background.submit, args=(_weights(2), 2))
        third.start()
        third.join(0.5)
        assert third.is_alive()  # the queue holds one copy: the third waits
        gate.set()
        third.join(30)
        assert not third.is_alive()
        last = background.result(2, timeout=30)
        assert (last.version, last.base_version) == (2, 1) and background.result(1).base_version == 0
        with pytest.raises(ValueError, match="version 0 was superseded by version 2"):
            background.result(0)
        with pytest.raises(ValueError, match="version 3 was not submitted"):
            background.result(3)
    finally:
        gate.set()
        background.close()


def test_an_encoding_error_reaches_whoever_asks_for_that_version():
    background = BackgroundPublisher(WeightPublisher(torch.bfloat16))
    try:
        background.submit({"z": torch.zeros(2, dtype=torch.complex64)}, 0)
        with pytest.raises(ValueError, match="no bit view for dtype torch.complex64"):
            background.result(0, timeout=30)
        background.submit(_weights(0), 1)
        assert not background.result(1, timeout=30).is_delta
    finally:
        background.close()
    with pytest.raises(RuntimeError, match="publisher is closed"):
        background.submit(_weights(0), 2)
