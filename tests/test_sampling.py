"""Sampler and SamplingParams (no model needed)."""

from __future__ import annotations

import math

import pytest
import torch

from edgemoe.engine.sampling import (
    SamplingParams,
    SamplingParamsError,
    apply_penalties,
    apply_top_k_top_p,
    make_generator,
    sample,
)


def _logits(b=6, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * 3


def test_greedy_rows_are_exact_argmax():
    x = _logits()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 3
    out = sample(x, params)
    assert out.dtype == torch.int64 and out.shape == (6,)
    for i in range(0, 6, 2):
        assert out[i].item() == x[i].argmax().item()
    assert torch.equal(sample(x, [SamplingParams(temperature=0)] * 6), x.argmax(-1))


def test_top_k_mask_keeps_exactly_k_largest():
    x = _logits(3, 40)
    masked = apply_top_k_top_p(x, torch.tensor([3, 0, 40]), None)
    kept = torch.isfinite(masked)
    assert kept[0].sum() == 3
    assert set(kept[0].nonzero().flatten().tolist()) == set(x[0].topk(3).indices.tolist())
    assert kept[1].all() and kept[2].all()  # 0 and V mean "off"
    assert torch.equal(masked[0][kept[0]], x[0][kept[0]])  # kept values unchanged


def test_top_p_mask_is_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 4)
    logits = probs.log()
    masked = apply_top_k_top_p(logits, None, torch.tensor([0.7, 0.8, 0.81, 1.0]))
    kept = torch.isfinite(masked).sum(-1).tolist()
    assert kept == [2, 2, 3, 4]
    # The most likely token always survives, even for a tiny p.
    assert torch.isfinite(apply_top_k_top_p(logits[:1], None, torch.tensor([1e-6])))[0, 0]


def test_top_k_then_top_p_and_top_k_1_is_greedy():
    x = _logits(4, 100, seed=3)
    both = apply_top_k_top_p(x, torch.tensor([5] * 4), torch.tensor([0.5] * 4))
    assert (torch.isfinite(both).sum(-1) <= 5).all()
    params = [SamplingParams(temperature=1.5, top_k=1)] * 4
    assert torch.equal(sample(x, params), x.argmax(-1))


def test_samples_stay_inside_the_mask():
    x = _logits(1, 30, seed=5).repeat(200, 1)
    out = sample(x, [SamplingParams(temperature=2.0, top_k=4)] * 200)
    assert set(out.tolist()) <= set(x[0].topk(4).indices.tolist())
    assert len(set(out.tolist())) > 1  # actually random at temperature 2


def test_seed_reproducible_and_batch_independent():
    x = _logits(1, 1000, seed=7)
    p = SamplingParams(temperature=1.0, seed=1234)

    def draw(batch_rows: int, steps: int = 20) -> list[int]:
        gen = make_generator(p, "cpu")
        others = [SamplingParams(temperature=1.0)] * (batch_rows - 1)
        toks = []
        for _ in range(steps):
            logits = torch.cat([x, _logits(batch_rows - 1, 1000, seed=len(toks))]) if batch_rows > 1 else x
            toks.append(sample(logits, [p, *others], [gen] + [None] * (batch_rows - 1))[0].item())
        return toks

    a, b, c = draw(1), draw(1), draw(5)
    assert a == b == c
    other = SamplingParams(temperature=1.0, seed=99)
    gen = make_generator(other, "cpu")
    d = [sample(x, [other], [gen])[0].item() for _ in range(20)]
    assert d != a
    assert make_generator(SamplingParams(temperature=0, seed=1), "cpu") is None  # greedy needs no RNG


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 2.0}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"frequency_penalty": True}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
    ],
)
def test_validation_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:") as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, SamplingParamsError) and info.value.field == field


def test_defaults_and_normalization():
    p = SamplingParams(stop="###", top_k=-1, max_tokens=None)
    assert p.stop == ["###"] and p.stop_token_ids == [] and p.max_tokens is None
    assert not p.greedy and SamplingParams(temperature=0).greedy
    with pytest.raises(ValueError, match="params"):
        sample(_logits(2), [SamplingParams()])


def test_penalties_match_their_definitions():
    """Repetition over prompt and output (positive logits divided, negative multiplied), then frequency times the
    output count and presence once per output token, against a per-token loop; masked logits stay masked."""
    logits = _logits(1, 12, 3)[0]
    logits[11] = -math.inf
    prompt, output = [0, 1, 1, 11], [2, 2, 2, 3, 0]
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.3)
    got = apply_penalties(logits, prompt, output, p)
    want = logits.clone()
    for t in range(12):
        if t in prompt or t in output:
            want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
        n = output.count(t)
        want[t] = want[t] - (-0.25) * n - 0.5 * (n > 0)
    torch.testing.assert_close(got, want)
    assert got[11] == -math.inf and torch.equal(logits[11], torch.tensor(-math.inf))  # the input is not modified
    assert p.penalized and not SamplingParams().penalized
    assert torch.equal(apply_penalties(logits, prompt, [], SamplingParams(presence_penalty=2)), logits)
