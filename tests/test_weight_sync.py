"""Delta weight sync: subscribers rebuild the published weights bit for bit."""
import pytest
import torch

from megatron_composer.rl.async_rl.weight_sync import WeightPublisher, WeightSubscriber, unchanged_fraction


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
