import json
import math

import aqn
import pytest
import torch
from aqn import make_schedule, schedule_from_state_dict

KINDS = ("exponential", "linear", "cosine", "logarithmic", "constant")


def paper_sigma(k: int, a: float = 1e-2, b: float = 1e-4, K: int = 10) -> float:
    return 0.0 if k == 0 else a * (b / a) ** ((k - 1) / (K - 1))


def test_exponential_is_the_paper_formula_at_every_stage_boundary():
    s = make_schedule("exponential", 1e-2, 1e-4, 10, total_steps=100)
    assert isinstance(s, aqn.ExponentialSigmaSchedule)
    for k in range(10):
        first = 10 * k
        assert s.stage(first) == k
        assert s.stage(first + 9) == k
        if k:
            assert s.stage(first - 1) == k - 1
        assert s.sigma(first) == pytest.approx(paper_sigma(k), rel=1e-12)
        assert s.sigma(first + 9) == pytest.approx(paper_sigma(k), rel=1e-12)
    assert s.sigma(0) == 0.0  # stage 0: quantization noise only
    assert s.sigma(10) == pytest.approx(1e-2)
    # paper convention: the last stage (K-1) is σ_start·(σ_end/σ_start)^((K-2)/(K-1)), not σ_end
    assert s.sigma(99) == pytest.approx(1e-2 * 1e-2 ** (8 / 9))
    assert s.sigma(99) == pytest.approx(1.6681e-4, rel=1e-4)


def test_matches_paper_algorithm_1_when_stages_divide_steps():
    T, K = 600, 10
    s = make_schedule("exponential", 1e-2, 5e-4, K, total_steps=T)
    per = T // K
    for step1 in range(1, T + 1):  # Algorithm 1 counts steps from 1
        k = (step1 - 1) // per
        assert s.stage(step1 - 1) == k
        assert s.sigma(step1 - 1) == pytest.approx(paper_sigma(k, 1e-2, 5e-4, K), rel=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_reach_end_hits_sigma_end_in_the_last_stage(kind):
    s = make_schedule(kind, 1e-2, 1e-4, 10, total_steps=1000, reach_end=True)
    last = s.sigma(999)
    if kind == "constant":
        assert last == 1e-2 and s.sigma(0) == 1e-2
    else:
        assert s.sigma(0) == 0.0
        assert s.sigma(100) == pytest.approx(1e-2, rel=1e-12)
        assert last == pytest.approx(1e-4, rel=1e-9)


@pytest.mark.parametrize("kind", ["exponential", "linear", "cosine", "logarithmic"])
def test_decay_kinds_start_at_sigma_start_and_decrease(kind):
    s = make_schedule(kind, 1e-2, 1e-4, 10, total_steps=100)
    sig = s.stage_sigmas()
    assert sig[0] == 0.0
    assert sig[1] == pytest.approx(1e-2)
    assert all(a > b for a, b in zip(sig[1:], sig[2:])), sig
    assert all(x >= 1e-4 for x in sig[1:])


def test_shapes_at_known_points():
    a, b = 1e-2, 1e-4
    kw = dict(sigma_start=a, sigma_end=b, num_stages=10, total_steps=10)
    assert aqn.LinearSigmaSchedule(**kw).shape(0.5) == pytest.approx((a + b) / 2)
    assert aqn.CosineSigmaSchedule(**kw).shape(0.5) == pytest.approx((a + b) / 2)
    assert aqn.CosineSigmaSchedule(**kw).shape(0.25) == pytest.approx(b + (a - b) * (1 + math.cos(math.pi / 4)) / 2)
    assert aqn.ExponentialSigmaSchedule(**kw).shape(0.5) == pytest.approx(math.sqrt(a * b))
    log = aqn.LogarithmicSigmaSchedule(**kw)
    assert log.shape(0) == pytest.approx(a) and log.shape(1) == pytest.approx(b)
    assert log.shape(0.25) < aqn.LinearSigmaSchedule(**kw).shape(0.25)  # drops faster early
    assert aqn.ConstantSigmaSchedule(**kw).shape(0.7) == a


@pytest.mark.parametrize("T", [7, 10, 25, 101, 999])
def test_stage_bounds_are_contiguous_and_near_equal(T):
    s = make_schedule("linear", 1e-2, 1e-4, 10, total_steps=T)
    bounds = s.stage_bounds()
    assert bounds[0][0] == 0 and bounds[-1][1] == T
    assert all(bounds[i][1] == bounds[i + 1][0] for i in range(9))
    lengths = [e - b for b, e in bounds]
    assert max(lengths) - min(lengths) <= 1
    for step in range(T):
        k = s.stage(step)
        assert bounds[k][0] <= step < bounds[k][1]


def test_steps_past_the_end_stay_in_the_last_stage_and_negative_steps_fail():
    s = make_schedule(total_steps=50)
    assert s.stage(50) == s.stage(10_000) == 9
    assert s.sigma(10_000) == s.sigma(49)
    with pytest.raises(ValueError):
        s.sigma(-1)


def test_numpy_integers_are_integers():
    # step counts computed with numpy were refused: "total_steps must be an integer, got np.int64(100)"
    import numpy as np

    s = make_schedule(num_stages=np.int64(4), total_steps=np.int64(100))
    assert (s.num_stages, s.total_steps) == (4, 100) and type(s.total_steps) is int
    assert s.stage(np.int32(50)) == s.stage(50) == 2
    assert json.loads(json.dumps(s.state_dict())) == s.state_dict()
    for bad in (np.float32(5.5), True, np.bool_(True), "5"):
        with pytest.raises(ValueError, match="step must be an integer"):
            s.stage(bad)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sigma_start=-1e-2), "sigma_start must be >= 0"),
        (dict(sigma_end=-1e-4), "sigma_end must be >= 0"),
        (dict(sigma_start=float("nan")), "finite"),
        (dict(num_stages=1), "num_stages must be >= 2"),
        (dict(num_stages=0), "num_stages must be >= 2"),
        (dict(total_steps=None), "total_steps is unknown"),
        (dict(total_steps=0), "total_steps must be >= 1"),
        (dict(total_steps=-5), "total_steps must be >= 1"),
    ],
)
@pytest.mark.parametrize("kind", KINDS)
def test_clear_errors(kind, kwargs, match):
    args = dict(sigma_start=1e-2, sigma_end=1e-4, num_stages=10, total_steps=100) | kwargs
    with pytest.raises(ValueError, match=match):
        make_schedule(kind, **args)


def test_exponential_needs_positive_ends_and_unknown_kind_fails():
    with pytest.raises(ValueError, match="exponential"):
        make_schedule("exponential", 1e-2, 0.0, 10, total_steps=100)
    assert make_schedule("linear", 1e-2, 0.0, 10, total_steps=100, reach_end=True).sigma(99) == 0.0
    with pytest.raises(ValueError, match="unknown AQN schedule kind"):
        make_schedule("step", total_steps=100)
    assert isinstance(make_schedule("log", total_steps=10), aqn.LogarithmicSigmaSchedule)


@pytest.mark.parametrize("kind", KINDS)
def test_state_dict_round_trip_resumes_in_the_same_stage_with_the_same_sigma(kind):
    s = make_schedule(kind, 2e-2, 5e-4, 7, total_steps=333, reach_end=(kind == "cosine"))
    state = json.loads(json.dumps(s.state_dict()))  # plain JSON-able state
    r = schedule_from_state_dict(state)
    assert type(r) is type(s) and r == s
    for step in (0, 47, 48, 100, 211, 332, 400):
        assert (r.stage(step), r.sigma(step)) == (s.stage(step), s.sigma(step))
    # load_state_dict into an existing object of the same kind
    other = make_schedule(kind, 1.0, 1.0, 2, total_steps=1)
    other.load_state_dict(state)
    assert other == s
    # wrong kind is an error, not a silent reinterpretation
    wrong = "linear" if kind != "linear" else "cosine"
    with pytest.raises(ValueError, match="schedule_from_state_dict"):
        make_schedule(wrong, total_steps=5).load_state_dict(state)


@pytest.mark.parametrize("kind", ["exponential", "linear", "cosine", "logarithmic"])
def test_reach_end_lands_exactly_on_sigma_end(kind):
    # documented "stage K-1 is exactly sigma_end" (and shape(1) == sigma_end), but linear and logarithmic ended a
    # rounding off it (0.01 -> 1e-4: 9.99999999999994e-05), so a log or check of the last stage's σ == σ_end failed
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    for _ in range(50):
        a, b = (10 ** (-4 * torch.rand((2,), generator=g, dtype=torch.float64) - 1)).tolist()
        K = int(torch.randint(3, 12, (), generator=g))
        s = aqn.make_schedule(kind, a, b, K, total_steps=10 * K, reach_end=True)
        assert s.shape(0) == a and s.shape(1) == b, (a, b)
        assert s.sigma(10 * K - 1) == b and s.stage_sigmas()[1] == a, (a, b, K)
        flat = aqn.make_schedule(kind, a, a, K, total_steps=10 * K)  # σ_start == σ_end: the same σ in every stage
        assert flat.stage_sigmas()[1:] == [a] * (K - 1)
