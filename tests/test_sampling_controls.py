"""Each logits control and sampling filter on hand-made distributions, with the expected values by hand.

Seed-reproducibility tests cannot tell a top-p that keeps one token too few from a correct one; these
read the filtered distribution itself. The sampler draws one uniform number u per token and picks the
token whose slice of the kept mass holds u, so sweeping u over a fine grid measures each kept token's
probability to within the grid step.
"""

from __future__ import annotations

import math

import pytest
import torch

from bm.runtime.logits import DecodingState, LogitsRow, apply_controls
from bm.runtime.sampler import Sampler
from bm.scheduling import Controls, Sampling

GRID = 2000  # u values swept: probabilities come out to within 1 / GRID


class SweepSampler(Sampler):
    """A sampler whose uniform draws are given, one per row, instead of coming from a seeded generator."""

    def __init__(self, draws: list[float]) -> None:
        super().__init__()
        self._draws = iter(draws)

    def _uniform(self, request_id: int, seed: int) -> float:
        return next(self._draws)


def filtered_distribution(logits: list[float], **params) -> dict[int, float]:
    """Token -> probability after temperature / top-k / top-p, measured by sweeping u over (0, 1)."""
    draws = [(i + 0.5) / GRID for i in range(GRID)]
    sampler = SweepSampler(draws)
    rows = torch.tensor([logits] * GRID, dtype=torch.float32)
    tokens = sampler.sample(rows, [Sampling(**params)] * GRID, list(range(GRID)))
    counts: dict[int, float] = {}
    for t in tokens:
        counts[t] = counts.get(t, 0.0) + 1.0 / GRID
    return counts


def log_probs(*probs: float) -> list[float]:
    return [math.log(p) for p in probs]


def assert_distribution(measured: dict[int, float], expected: dict[int, float]) -> None:
    assert set(measured) == set(expected), f"kept tokens {sorted(measured)}, expected {sorted(expected)}"
    for token, p in expected.items():
        assert measured[token] == pytest.approx(p, abs=1.5 / GRID), f"token {token}"


# -- temperature, top-k, top-p ---------------------------------------------------------------------------


def test_temperature_one_samples_the_softmax():
    measured = filtered_distribution(log_probs(0.5, 0.25, 0.125, 0.125), temperature=1.0)
    assert_distribution(measured, {0: 0.5, 1: 0.25, 2: 0.125, 3: 0.125})


def test_temperature_below_one_sharpens_as_p_to_the_power_one_over_t():
    # T = 0.5: p^2 = 1/4, 1/16, 1/16 -> normalised 2/3, 1/6, 1/6.
    measured = filtered_distribution(log_probs(0.5, 0.25, 0.25), temperature=0.5)
    assert_distribution(measured, {0: 2 / 3, 1: 1 / 6, 2: 1 / 6})


def test_temperature_above_one_flattens():
    # T = 2: sqrt(p) = 0.8, 0.2 ... of p = 0.64 / 0.04 / 0.32 -> 0.8, 0.2, sqrt(0.32) normalised.
    p = (0.64, 0.04, 0.32)
    roots = [math.sqrt(x) for x in p]
    measured = filtered_distribution(log_probs(*p), temperature=2.0)
    assert_distribution(measured, {i: r / sum(roots) for i, r in enumerate(roots)})


@pytest.mark.parametrize(
    ("top_k", "expected"),
    [
        (1, {1: 1.0}),  # top_k 1 is greedy
        (2, {1: 0.4 / 0.7, 3: 0.3 / 0.7}),
        (3, {1: 0.4 / 0.9, 3: 0.3 / 0.9, 0: 0.2 / 0.9}),
        (4, {1: 0.4, 3: 0.3, 0: 0.2, 2: 0.1}),
        (0, {1: 0.4, 3: 0.3, 0: 0.2, 2: 0.1}),  # 0: no top-k filter
    ],
)
def test_top_k_keeps_exactly_the_k_most_likely_renormalised(top_k, expected):
    measured = filtered_distribution(log_probs(0.2, 0.4, 0.1, 0.3), temperature=1.0, runtime_top_k=top_k)
    assert_distribution(measured, expected)


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        # The nucleus is the smallest set of most likely tokens whose mass reaches top_p.
        (0.3, {0: 1.0}),
        (0.499, {0: 1.0}),  # just under the first token's mass: it alone reaches it
        (0.501, {0: 0.5 / 0.75, 1: 0.25 / 0.75}),  # just over: the second token is needed
        (0.749, {0: 0.5 / 0.75, 1: 0.25 / 0.75}),
        (0.751, {0: 0.5 / 0.875, 1: 0.25 / 0.875, 2: 0.125 / 0.875}),
        (0.874, {0: 0.5 / 0.875, 1: 0.25 / 0.875, 2: 0.125 / 0.875}),
        (0.876, {0: 0.5, 1: 0.25, 2: 0.125, 3: 0.125}),
        (1.0, {0: 0.5, 1: 0.25, 2: 0.125, 3: 0.125}),
    ],
)
def test_top_p_keeps_the_smallest_nucleus_reaching_p(top_p, expected):
    measured = filtered_distribution(log_probs(0.5, 0.25, 0.125, 0.125), temperature=1.0, runtime_top_p=top_p)
    assert_distribution(measured, expected)


@pytest.mark.parametrize(("top_p", "kept"), [(0.25, 1), (0.5, 2), (0.75, 3), (0.7501, 4)])
def test_top_p_equal_to_a_nucleus_mass_keeps_exactly_that_nucleus(top_p, kept):
    # Four equal logits: probabilities are exactly 0.25 each, so the masses 0.25, 0.5, 0.75 are exact
    # and top_p equal to one of them is reached with that many tokens, no more.
    measured = filtered_distribution([0.0] * 4, temperature=1.0, runtime_top_p=top_p)
    assert len(measured) == kept
    assert all(p == pytest.approx(1 / kept, abs=1.5 / GRID) for p in measured.values())


def test_top_k_then_top_p_then_temperature_combine():
    # T = 0.5 squares (0.4, 0.3, 0.2, 0.1) -> (16, 9, 4, 1) / 30; top_k 3 keeps 16, 9, 4 (/ 29);
    # top_p 0.8: 16/29 = 0.55 < 0.8, 25/29 = 0.86 >= 0.8 -> the first two, 16/25 and 9/25.
    measured = filtered_distribution(
        log_probs(0.4, 0.3, 0.2, 0.1), temperature=0.5, runtime_top_k=3, runtime_top_p=0.8
    )
    assert_distribution(measured, {0: 16 / 25, 1: 9 / 25})


def test_greedy_rows_take_the_argmax_beside_sampled_rows():
    logits = torch.tensor([[0.1, 0.9, 0.3], [2.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    params = [Sampling(), Sampling(temperature=1.0, runtime_top_k=1), Sampling(temperature=0.0)]
    assert Sampler().sample(logits, params, [0, 1, 2]) == [1, 0, 2]


def _chi_square_sf_even_df(x: float, df: int) -> float:
    """P(X > x) for a chi-square variable with an even number of degrees of freedom (closed form)."""
    half = x / 2
    return math.exp(-half) * sum(half**i / math.factorial(i) for i in range(df // 2))


def test_seeded_sampling_follows_the_filtered_distribution():
    # 20000 requests with seeds 0..19999, one token each, from (0.35, 0.25, 0.2, 0.1, 0.06, 0.04) with
    # top_k 5 and top_p 0.85: the nucleus is the first 4 tokens (0.8 < 0.85 <= 0.9). Pearson's chi-square
    # over those 4 must not reject at p < 1e-6, and nothing outside them may be drawn. With fixed seeds
    # the outcome is deterministic; a correct sampler would fail this threshold once in a million seed sets.
    n = 20000
    probs = (0.35, 0.25, 0.2, 0.1, 0.06, 0.04)
    logits = torch.tensor([log_probs(*probs)] * n, dtype=torch.float32)
    params = [Sampling(temperature=1.0, runtime_top_k=5, runtime_top_p=0.85, random_seed=s) for s in range(n)]
    tokens = Sampler().sample(logits, params, list(range(n)))
    kept = {0: 0.35 / 0.9, 1: 0.25 / 0.9, 2: 0.2 / 0.9, 3: 0.1 / 0.9}
    outside = sum(1 for t in tokens if t not in kept)
    assert outside == 0, f"{outside} samples outside the nucleus"
    counts = [sum(1 for t in tokens if t == token) for token in kept]
    statistic = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, kept.values(), strict=True))
    # 4 bins -> 3 degrees of freedom; bound it by the 4-df tail (larger), which has a closed form.
    assert _chi_square_sf_even_df(statistic, 4) > 1e-6, (counts, statistic)


def test_each_seed_draws_the_same_token_whatever_shares_the_batch():
    logits = torch.tensor([log_probs(0.25, 0.25, 0.25, 0.25)] * 3)
    params = [Sampling(temperature=1.0, random_seed=s) for s in (7, 8, 9)]
    together = Sampler().sample(logits, params, [0, 1, 2])
    alone = [Sampler().sample(logits[:1], [p], [0])[0] for p in params]
    assert together == alone


def test_the_seed_not_the_request_id_decides_the_draws():
    # Two requests with one seed draw the same 16 tokens; a third with another seed does not.
    logits = torch.tensor([[0.0] * 8] * 3)
    params = [Sampling(temperature=1.0, random_seed=s) for s in (5, 5, 6)]
    sampler = Sampler()
    draws = [sampler.sample(logits, params, [10, 11, 12]) for _ in range(16)]
    assert [d[0] for d in draws] == [d[1] for d in draws]
    assert [d[0] for d in draws] != [d[2] for d in draws]


def test_each_request_draws_the_numbers_its_generator_gives_one_at_a_time_across_refills():
    """The sampler draws a request's uniform numbers ahead, DRAW_AHEAD at a time: every number it hands
    out is the one ``torch.rand(())`` on that request's seeded generator gives in turn, across several
    refills, requests interleaved, and a request released and admitted again starting over."""
    from bm.runtime.sampler import DRAW_AHEAD

    def one_at_a_time(seed: int, n: int) -> list[float]:
        gen = torch.Generator().manual_seed(seed)
        return [torch.rand((), generator=gen).item() for _ in range(n)]

    sampler = Sampler()
    n = 2 * DRAW_AHEAD + 5
    got = {7: [], 8: []}
    for _ in range(n):
        for rid, seed in ((7, 11), (8, 12)):
            got[rid].append(sampler.uniform(rid, seed))
    assert got == {7: one_at_a_time(11, n), 8: one_at_a_time(12, n)}
    sampler.release(7)
    assert [sampler.uniform(7, 11) for _ in range(3)] == one_at_a_time(11, 3)


# -- logits controls (bm/runtime/logits.py) ------------------------------------------------------------


def decoding_state(**controls) -> DecodingState:
    """The runtime's state for these controls, as the executor builds it on admission."""
    state = DecodingState(Controls(**controls))
    if state.controls.embedding_bias is not None:
        state.bias = torch.tensor(state.controls.embedding_bias, dtype=torch.float32)
    return state


def controlled(
    logits: list[float], prompt: list[int], output: list[int], end_id: int = -1, **options
) -> list[float]:
    row = LogitsRow(
        request_id=0, state=decoding_state(**options), prompt=prompt, output=output, end_id=end_id
    )
    return apply_controls(torch.tensor([logits]), [row])[0].tolist()


NEG = float("-inf")


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    # Seen (prompt 0, output 1): 2 / 2 = 1, -2 * 2 = -4; unseen 2 and 3 unchanged.
    out = controlled([2.0, -2.0, 1.0, 0.5], prompt=[0], output=[1], repetition_penalty=2.0)
    assert out == [1.0, -4.0, 1.0, 0.5]


def test_repetition_penalty_below_one_boosts_seen_tokens():
    out = controlled([2.0, -2.0, 1.0], prompt=[0, 1], output=[], repetition_penalty=0.5)
    assert out == [4.0, -1.0, 1.0]


def test_presence_and_frequency_penalties_count_the_output_only():
    # Output 2, 2, 3: token 2 -> -(0.5 + 2 * 0.25) = -1; token 3 -> -(0.5 + 0.25) = -0.75;
    # token 0 is in the prompt only: unchanged.
    out = controlled(
        [1.0, 1.0, 1.0, 1.0], prompt=[0], output=[2, 2, 3], presence_penalty=0.5, frequency_penalty=0.25
    )
    assert out == [1.0, 1.0, 0.0, 0.25]


@pytest.mark.parametrize(("generated", "banned"), [(0, True), (1, True), (2, False), (3, False)])
def test_min_length_bans_the_end_token_until_min_length_tokens_are_out(generated, banned):
    out = controlled([1.0, 2.0, 3.0], prompt=[0], output=[1] * generated, end_id=2, min_length=2)
    assert out == ([1.0, 2.0, NEG] if banned else [1.0, 2.0, 3.0])


def test_min_length_without_an_end_token_bans_nothing():
    assert controlled([1.0, 2.0, 3.0], prompt=[0], output=[], end_id=-1, min_length=5) == [1.0, 2.0, 3.0]


@pytest.mark.parametrize(
    ("prompt", "output", "banned"),
    [
        ([0], [5], {6, 7}),  # ends with 5: the word (5, 6) would complete
        ([5], [], {6, 7}),  # ... also when the 5 is the prompt's last token
        ([0], [5, 1], {7}),  # 5 is not the last token: only the one-token word stays banned
        ([4, 5], [], {6, 7, 1}),  # (4, 5, 1) completes across the prompt
        ([0, 4], [5], {6, 7, 1}),  # ... and across prompt and output
        ([0, 3], [5], {6, 7}),  # (3, 5) is not (4, 5)
    ],
)
def test_bad_words_ban_the_token_that_would_complete_a_word(prompt, output, banned):
    out = controlled([0.0] * 8, prompt=prompt, output=output, bad_words_list=((5, 6), (7,), (4, 5, 1)))
    assert {i for i, x in enumerate(out) if x == NEG} == banned


def test_embedding_bias_is_added_to_the_logits():
    bias = (0.5, -1.0, 0.0, 2.0)  # Controls.embedding_bias's type, as requests carry it
    assert controlled([1.0, 1.0, 1.0, 1.0], prompt=[0], output=[], embedding_bias=bias) == [
        1.5,
        0.0,
        1.0,
        3.0,
    ]


@pytest.mark.parametrize(
    ("n", "sequence", "banned"),
    [
        (2, [1, 2, 3, 1], {2}),  # the bigram (1, 2) was seen: 2 after 1 again is banned
        (2, [1, 2, 1, 3, 1], {2, 3}),
        (2, [1, 2, 3, 4], set()),  # 4 never appeared before
        (3, [1, 2, 3, 1, 2], {3}),
        (3, [1, 2, 3, 2, 2], set()),  # (2, 2) never started a trigram
        (3, [1, 2], set()),  # too short for any trigram to repeat
        (1, [4, 1, 4], {1, 4}),  # unigrams: every seen token
        (2, [1, 1], {1}),  # the bigram ending at the last token counts too
        (2, [4, 2, 2], {2}),
    ],
)
def test_no_repeat_ngram_bans_tokens_that_would_repeat_an_ngram(n, sequence, banned):
    prompt, output = sequence[:1], sequence[1:]
    out = controlled([0.0] * 6, prompt=prompt, output=output, no_repeat_ngram_size=n)
    assert {i for i, x in enumerate(out) if x == NEG} == banned


def test_rows_without_controls_are_left_untouched():
    logits = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    row = LogitsRow(0, decoding_state(repetition_penalty=2.0), prompt=[1], output=[], end_id=-1)
    out = apply_controls(logits.clone(), [None, row])
    assert out.tolist() == [[1.0, 2.0], [3.0, 2.0]]
