"""N-gram baselines: hand-computed Kneser-Ney and add-k probabilities, normalization, back-off."""

import math

import numpy as np
import pytest

from core.errors import UserError
from tasks.nlp.ngram import KneserNey, Unigram, bits_per_character

# Toy vocabulary: 0 bos, 1 eos, 2 a, 3 b, 4 c, 5 d (d never occurs in training).
BOS, EOS, A, B, C, D_TOKEN = range(6)
V = 6
DOCUMENTS = [[A, B], [A, C, A], [B]]
DISCOUNT = 0.5

# Unigram level, the same at orders 2 and 3: continuation counts N1+(. w), the distinct tokens
# seen before w among the bigrams:
#   a: {bos, c} = 2    b: {a, bos} = 2    c: {a} = 1    eos: {b, a} = 2    bos, d: 0
# total S = 7 over 4 seen types, so B = 0.5 * 4 = 2 and P_1(w) = (max(N - 0.5, 0) + 2 * 1/6) / 7.
P1 = {
    A: (2 - DISCOUNT + DISCOUNT * 4 / V) / 7,
    B: (2 - DISCOUNT + DISCOUNT * 4 / V) / 7,
    C: (1 - DISCOUNT + DISCOUNT * 4 / V) / 7,
    EOS: (2 - DISCOUNT + DISCOUNT * 4 / V) / 7,
    BOS: (DISCOUNT * 4 / V) / 7,
    D_TOKEN: (DISCOUNT * 4 / V) / 7,
}


def test_unigram_level_sums_to_one_by_hand():
    assert sum(P1.values()) == pytest.approx(1.0, abs=1e-12)


def test_kneser_ney_order_2_by_hand():
    model = KneserNey(V, bos=BOS, eos=EOS, order=2, discount=DISCOUNT).fit(DOCUMENTS)
    # Bigrams (raw counts, the highest order): after bos: a 2, b 1 (S 3, 2 types);
    # after a: b 1, c 1, eos 1 (S 3, 3 types); after b: eos 2 (S 2, 1 type); after c: a 1 (S 1).
    # P_2(w | h) = (max(c(h w) - 0.5, 0) + 0.5 * types(h) * P_1(w)) / S(h).
    p_a_after_bos = (2 - 0.5 + 0.5 * 2 * P1[A]) / 3
    p_b_after_a = (1 - 0.5 + 0.5 * 3 * P1[B]) / 3
    p_eos_after_b = (2 - 0.5 + 0.5 * 1 * P1[EOS]) / 2
    assert model.probabilities([])[A] == pytest.approx(p_a_after_bos, abs=1e-9)
    assert model.probabilities([A])[B] == pytest.approx(p_b_after_a, abs=1e-9)
    # Seen contexts give unseen followers only their share of the back-off mass.
    assert model.probabilities([B])[C] == pytest.approx(0.5 * 1 * P1[C] / 2, abs=1e-9)
    assert model.probabilities([C])[D_TOKEN] == pytest.approx(0.5 * 1 * P1[D_TOKEN] / 1, abs=1e-9)
    # d never occurs, so as a context it backs off to the unigram level.
    assert model.probabilities([D_TOKEN]) == pytest.approx(np.array([P1[w] for w in range(V)]), abs=1e-9)
    total, count = model.log_prob([[A, B]])
    assert count == 3
    assert total == pytest.approx(math.log(p_a_after_bos * p_b_after_a * p_eos_after_b), abs=1e-9)


def test_kneser_ney_order_3_by_hand():
    model = KneserNey(V, bos=BOS, eos=EOS, order=3, discount=DISCOUNT).fit(DOCUMENTS)
    # Order 3 (raw counts): after (bos, bos): a 2, b 1 (S 3, 2 types); after (bos, a): b 1, c 1
    # (S 2, 2 types); after (a, b), (a, c), (c, a), (bos, b): one token once (S 1, 1 type).
    # Order 2: bigrams that start with bos keep raw counts (bos a: 2, bos b: 1, so after bos
    # S 3, 2 types); the others count their distinct left neighbours among the trigrams:
    #   a b: {bos} 1   a c: {bos} 1   a eos: {c} 1   c a: {a} 1   b eos: {a, bos} 2
    # so after a: S 3, 3 types; after b: S 2, 1 type; after c: S 1, 1 type.
    p2_a_after_bos = (2 - 0.5 + 0.5 * 2 * P1[A]) / 3
    p2_b_after_a = (1 - 0.5 + 0.5 * 3 * P1[B]) / 3
    p2_eos_after_b = (2 - 0.5 + 0.5 * 1 * P1[EOS]) / 2
    p3_a_after_bos_bos = (2 - 0.5 + 0.5 * 2 * p2_a_after_bos) / 3
    p3_b_after_bos_a = (1 - 0.5 + 0.5 * 2 * p2_b_after_a) / 2
    p3_eos_after_a_b = (1 - 0.5 + 0.5 * 1 * p2_eos_after_b) / 1
    assert model.probabilities([])[A] == pytest.approx(p3_a_after_bos_bos, abs=1e-9)
    assert model.probabilities([A])[B] == pytest.approx(p3_b_after_bos_a, abs=1e-9)
    assert model.probabilities([A, B])[EOS] == pytest.approx(p3_eos_after_a_b, abs=1e-9)
    total, count = model.log_prob([[A, B]])
    assert count == 3
    assert total == pytest.approx(math.log(p3_a_after_bos_bos * p3_b_after_bos_a * p3_eos_after_a_b), abs=1e-9)
    # Context (c, b) never occurs: back off to the order-2 context b exactly.
    assert model.probabilities([C, B])[EOS] == pytest.approx(p2_eos_after_b, abs=1e-9)
    # Context (b, a) never occurs either: order 2 after a, whose unseen follower a takes back-off mass.
    assert model.probabilities([B, A])[A] == pytest.approx(0.5 * 3 * P1[A] / 3, abs=1e-9)
    # Only the last order - 1 tokens of a long context count.
    assert model.probabilities([C, C, C, A, B]) == pytest.approx(model.probabilities([A, B]), abs=1e-12)


def test_modified_discounts_from_count_of_counts():
    # Order 1 over raw counts: ids 2-5 once (n1 = 4), 6 and 7 twice (n2 = 2), 8 three times
    # (n3 = 1), 9 four times (n4 = 1). Y = 4 / (4 + 2 * 2) = 0.5; D1 = 1 - 2 * 0.5 * 2 / 4 = 0.5;
    # D2 = 2 - 3 * 0.5 * 1 / 2 = 1.25; D3+ = 3 - 4 * 0.5 * 1 / 1 = 1.
    document = [2, 3, 4, 5, 6, 6, 7, 7, 8, 8, 8, 9, 9, 9, 9]
    model = KneserNey(10, bos=0, order=1).fit([document])
    assert model.discounts == [pytest.approx((0.5, 1.25, 1.0), abs=1e-12)]
    # S = 15; B = 0.5 * 4 + 1.25 * 2 + 1 * 2 = 6.5; P(w) = (c - D(c) + 6.5 / 10) / 15.
    probabilities = model.probabilities()
    assert probabilities[2] == pytest.approx((1 - 0.5 + 0.65) / 15, abs=1e-9)
    assert probabilities[6] == pytest.approx((2 - 1.25 + 0.65) / 15, abs=1e-9)
    assert probabilities[9] == pytest.approx((4 - 1 + 0.65) / 15, abs=1e-9)
    assert probabilities[0] == pytest.approx(0.65 / 15, abs=1e-9)
    # Without all of n1..n4 the estimate is undefined and the order falls back to 0.75.
    assert KneserNey(10, bos=0, order=1).fit([[2, 3, 3]]).discounts == [(0.75, 0.75, 0.75)]


@pytest.mark.parametrize("order", [1, 2, 3, 5])
@pytest.mark.parametrize("discount", [None, 0.75, 1.0])
def test_probabilities_sum_to_one_for_any_context(order, discount):
    rng = np.random.default_rng(order)
    documents = [list(rng.integers(2, 9, size=rng.integers(0, 15))) for _ in range(30)]
    model = KneserNey(12, bos=0, eos=1, order=order, discount=discount).fit(documents)
    # Seen, partly seen and unseen contexts, the start of a document, and ids never trained on.
    for context in ([], [2], [2, 3], [3, 2, 4, 5], [10, 11], [11, 2, 3, 4, 5, 6], [1, 1]):
        probabilities = model.probabilities(context)
        assert probabilities.shape == (12,)
        assert probabilities.sum() == pytest.approx(1.0, abs=1e-12)
        assert (probabilities > 0).all()


def test_token_log_probs_agree_with_probabilities():
    documents = [[2, 3, 4, 2, 3], [4, 4, 2], []]
    model = KneserNey(6, bos=0, eos=1, order=3).fit(documents)
    document = [2, 3, 5, 4]
    values = model.token_log_probs([document])
    assert values.shape == (5,)  # four tokens and eos
    for position, token in enumerate([*document, 1]):
        assert values[position] == pytest.approx(math.log(model.probabilities(document[:position])[token]), abs=1e-12)
    # Without eos nothing is appended, and an empty document predicts nothing.
    plain = KneserNey(6, bos=0, order=3).fit(documents)
    assert plain.log_prob([[], [2, 3]])[1] == 2


def test_higher_order_beats_unigram_on_patterned_text():
    pattern = [2, 3, 4, 5, 6, 7] * 20
    model = KneserNey(8, bos=0, eos=1, order=5).fit([pattern] * 3)
    unigram = Unigram(8, eos=1).fit([pattern] * 3)
    assert model.log_prob([pattern])[0] > unigram.log_prob([pattern])[0] + 100


def test_unigram_add_k_by_hand():
    # Counts with eos: 2 once, 3 twice, 4 once, eos twice (6 tokens); k = 0.5 over 6 ids:
    # P(w) = (count + 0.5) / (6 + 0.5 * 6).
    model = Unigram(6, smoothing=0.5, eos=1).fit([[2, 3, 3], [4]])
    assert model.probabilities() == pytest.approx(np.array([0.5, 2.5, 1.5, 2.5, 1.5, 0.5]) / 9, abs=1e-12)
    total, count = model.log_prob([[3, 5]])
    assert count == 3
    assert total == pytest.approx(math.log(2.5 / 9) + math.log(0.5 / 9) + math.log(2.5 / 9), abs=1e-12)
    # Add-one, no eos: P(w) = (count + 1) / (4 + 6).
    add_one = Unigram(6).fit([[2, 3, 3], [4]])
    assert add_one.probabilities()[3] == pytest.approx(3 / 10, abs=1e-12)
    assert add_one.log_prob([[]]) == (0.0, 0)


def test_bits_per_character():
    assert bits_per_character(-math.log(2) * 10, 5) == pytest.approx(2.0)


def test_bad_input_is_reported():
    model = KneserNey(6, bos=0, eos=1, order=2)
    with pytest.raises(RuntimeError, match="fit"):
        model.log_prob([[2]])
    with pytest.raises(UserError, match="Sequence 1 holds the id 6"):
        model.fit([[2], [6]])
    with pytest.raises(UserError, match="bos id 0"):
        model.fit([[2, 0, 3]])
    with pytest.raises(UserError, match="flat list"):
        model.fit([[[2, 3]]])
    with pytest.raises(UserError, match="discount"):
        KneserNey(6, bos=0, discount=1.5)
    with pytest.raises(UserError, match="smoothing"):
        Unigram(6, smoothing=0)


def test_empty_training_corpus_gives_the_uniform_distribution():
    model = KneserNey(5, bos=0, order=3).fit([])
    assert model.probabilities([2]) == pytest.approx(np.full(5, 0.2), abs=1e-12)
    assert model.log_prob([[2, 3]]) == (pytest.approx(2 * math.log(0.2), abs=1e-12), 2)
