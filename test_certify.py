"""The two certificates: the masking certificate of a reranker's top k (certify.py) checked against
exhaustive enumeration, and RobustRAG's keyword certificate (defenses.keyword_certified) against every
corruption of a small case."""
import itertools
import math
import random

import pytest

import certify
import defenses


def all_masks(words, keep):
    return [" ".join(words[i] for i in idx) for idx in itertools.combinations(range(len(words)), keep)]


def exact_g(score, text, rate):
    """g(d) over every mask (the expectation certify.smoothed estimates)."""
    words = text.split()
    keep = max(1, len(words) - round(rate * len(words)))
    ms = all_masks(words, keep)
    return sum(score(m) for m in ms) / len(ms)


@pytest.mark.parametrize("n,p,rate", [(10, 0.1, 0.5), (12, 0.2, 0.7), (9, 0.3, 0.6), (10, 0.05, 0.9)])
def test_delta_is_the_share_of_masks_that_see_an_edit(n, p, rate):
    """Δ(p) = 1 - C(n-e, h)/C(n, h) counted mask by mask: the masks that keep an edited position."""
    keep = max(1, n - round(rate * n))
    e = math.ceil(p * n)
    edited = set(range(e))
    masks = list(itertools.combinations(range(n), keep))
    seen = sum(bool(edited & set(m)) for m in masks) / len(masks)
    assert certify.delta(n, p, rate) == pytest.approx(seen, abs=1e-12)


def test_no_substitution_moves_the_smoothed_score_by_more_than_delta():
    """The bound itself, exhaustively: for a bounded scorer and every placement of e substituted words,
    |g(d') - g(d)| <= Δ(p) over the exact expectation (no Monte Carlo)."""
    rng = random.Random(0)
    score = lambda t: sum(w in ("trusted", "best", "official") for w in t.split()) / 3      # in [0, 1]
    words = "the guide lists trusted official sources and the best practice for travel".split()
    rate, p = 0.6, 0.2
    e = math.ceil(p * len(words))
    g = exact_g(score, " ".join(words), rate)
    worst = 0.0
    for pos in itertools.combinations(range(len(words)), e):
        edited = list(words)
        for i in pos:
            edited[i] = rng.choice(["best", "trusted", "official", "xyz"])
        worst = max(worst, abs(exact_g(score, " ".join(edited), rate) - g))
    assert 0 < worst <= certify.delta(len(words), p, rate) + 1e-12


def test_masks_are_seeded_by_the_text():
    text = "one two three four five six seven eight nine ten"
    a, b = certify.masks(text, 0.7, 5, seed=1), certify.masks(text, 0.7, 8, seed=1)
    assert a == b[:5] and len(set(a)) > 1             # more samples extend the same masks (their scores cached)
    assert certify.masks(text, 0.7, 5, seed=2) != a


def test_masks_keep_the_word_order():
    text = "one two three four five six seven eight nine ten"
    a = certify.masks(text, 0.7, 5, seed=1)
    for m in a:
        ws = m.split()
        assert len(ws) == 3 and ws == [w for w in text.split() if w in ws]


def test_the_radius_is_the_largest_p_the_margin_covers():
    """Document 0 sits below four clearly better documents: certified while eps + Δ(p) fits the gap."""
    g = [0.10, 0.95, 0.94, 0.93, 0.92, 0.20]
    n, rate, eps = 200, 0.9, 0.05
    r = certify.certified_radius(g, 0, n, k=3, eps=eps, rate=rate)
    assert r in certify.GRID
    for p in certify.GRID:                           # exactly the p whose Δ leaves the top 3's lower bound above
        assert (p <= r) == (g[0] + eps + certify.delta(n, p, rate) < g[3] - eps)
    assert certify.certified_radius(g, 1, n, k=3, eps=eps, rate=rate) == 0.0    # already in the top k
    assert certify.certified_radius(g, 0, n, k=3, eps=0.5, rate=rate) == 0.0    # too few masks to say anything


def test_edit_fraction_counts_insertions_deletions_and_substitutions():
    assert certify.edit_fraction("a b c d", "a b c d") == 0
    assert certify.edit_fraction("a b c d", "a x c d") == 0.25
    assert certify.edit_fraction("a b c d", "a b c d e f") == 0.5
    assert certify.edit_fraction("a b c d", "b c d") == 0.25


# ----------------------------------------------------------------------------- RobustRAG's certificate

WHALE = "Blue whales sing low songs that carry across whole ocean basins."
OTHER = ["Ticket prices rise every summer at the old harbour museum.", "Penguins dive for krill near icy shelves.",
         "The museum shop sells maps of the harbour.", "I don't know."]


def kept(answers):
    sets = [defenses.phrases(a) for a in answers if isinstance(a, str) and not defenses.abstains(a)]
    mu = min(defenses.BETA, defenses.ALPHA * len(sets))
    count = {}
    for s in sets:
        for p in s:
            count[p] = count.get(p, 0) + 1
    return {p for p, c in count.items() if c >= mu and p not in defenses.FUNCTION_WORDS and " " in p}


def test_keyword_certificate_holds_against_every_corruption_it_claims():
    """Each small case: when the certificate says K' corrupted answers cannot change the kept phrases,
    replacing any K' answers by any of the candidates (a whale answer, unrelated ones, an abstention)
    leaves the thresholded set as it was; the unanimous case is certified at 1 and not at 2."""
    cases = [[WHALE] * 5, [WHALE] * 4 + [OTHER[0]], [WHALE] * 3 + OTHER[:2], [WHALE] * 2 + OTHER[:3],
             [WHALE] * 7 + [OTHER[0]]]
    pool = [WHALE] + OTHER
    claimed = 0
    for answers in cases:
        for kk in (1, 2):
            if not defenses.keyword_certified(answers, kk):
                continue
            claimed += 1
            base = kept(answers)
            for pos in itertools.combinations(range(len(answers)), kk):
                for repl in itertools.product(pool, repeat=kk):
                    changed = list(answers)
                    for i, t in zip(pos, repl):
                        changed[i] = t
                    assert kept(changed) == base, (answers, pos, repl)
    assert defenses.keyword_certified([WHALE] * 5, 1) and not defenses.keyword_certified([WHALE] * 5, 2)
    assert not defenses.keyword_certified([WHALE] * 4 + [OTHER[0]], 1)    # one more "ticket prices" reaches mu
    assert claimed == 2
    assert not defenses.keyword_certified(["I don't know."] * 5, 1)      # nothing kept, nothing certain


@pytest.mark.parametrize("call", [lambda: certify.epsilon(10, 32, alpha=float("nan")),
                                  lambda: certify.epsilon(10, 0), lambda: certify.epsilon(0, 32),
                                  lambda: certify.delta(100, -0.1, 0.9), lambda: certify.delta(100, 0.1, 1.0),
                                  lambda: certify.delta(100, float("nan"), 0.9), lambda: certify.delta(0, 0.1, 0.9),
                                  lambda: defenses.keyword_certified(["the red fox"], -1),
                                  lambda: defenses.keyword_certified(["the red fox"], 1, alpha=float("nan")),
                                  lambda: defenses.keyword_certified(["the red fox"], 1.5)])
def test_the_certificates_refuse_inputs_outside_their_bounds(call):
    """alpha = nan, a negative p or corrupted count, a mask rate of 1: each a ValueError naming the input, never
    a certificate computed from it (nan passes no comparison, so it would certify nothing silently or all)."""
    with pytest.raises(ValueError, match=r"(alpha|p|rate|n_docs|n_samples|n_words|corrupted) = "):
        call()
