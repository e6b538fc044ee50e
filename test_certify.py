"""The two certificates: the randomized-deletion certificate of a reranker's top k (certify.py) checked
against exhaustive enumeration, and RobustRAG's keyword certificate (defenses.keyword_certified) against
every corruption of a small case."""
import itertools
import math
import random

import pytest

import certify
import defenses


def exact_g(score, words, p):
    """g(d) = E[score(δ(d))] over every deletion pattern of `words` (the expectation certify.smoothed
    estimates): each word deleted independently with probability p."""
    total = 0.0
    for keep in itertools.product((False, True), repeat=len(words)):
        prob = math.prod((1 - p) if k else p for k in keep)
        total += prob * score([w for w, k in zip(words, keep) if k])
    return total


WORDS = "guide lists trusted sources for travel".split()
VOCAB = ("trusted", "best", "official")
SCORES = {   # bounded scores in [0, 1]: additive, order-sensitive, and all-or-nothing
    "count": lambda ws: sum(w in VOCAB for w in ws) / 3 if len(ws) < 9 else 1.0,
    "order": lambda ws: 1.0 if any(a == "best" and b == "travel" for a, b in zip(ws, ws[1:])) else 0.2,
    "short": lambda ws: 1.0 if len(ws) <= 2 else 0.0}


def edits(words, r, kind):
    """Every edit of r words of `kind` with the inserted words drawn from VOCAB + one foreign word (an insertion
    of r words: some more than once, by different orders of insertion)."""
    pool = VOCAB + ("xyz",)
    if kind == "deleted":
        for pos in itertools.combinations(range(len(words)), r):
            yield [w for i, w in enumerate(words) if i not in pos]
    elif kind == "substituted":
        for pos in itertools.combinations(range(len(words)), r):
            for new in itertools.product(pool, repeat=r):
                out = list(words)
                for i, w in zip(pos, new):
                    out[i] = w
                yield out
    elif r == 0:
        yield list(words)
    else:                  # one word at a time, anywhere: two words into one gap come in both orders
        for i in range(len(words) + 1):
            for w in pool:
                yield from edits(words[:i] + [w] + words[i:], r - 1, kind)


@pytest.mark.parametrize("kind", list(certify.KINDS))
@pytest.mark.parametrize("p", [0.5, 0.8])
def test_no_edit_moves_the_smoothed_score_past_the_bound(kind, p):
    """The bound itself, exhaustively: for each score, every edit of r = 1, 2 words of the kind gives an
    exact smoothed score (every deletion pattern, no Monte Carlo) at most U(g; r) of certify.upper."""
    ins, dels = certify.KINDS[kind]
    for name, score in SCORES.items():
        g = exact_g(score, WORDS, p)
        for r in (1, 2):
            bound = certify.upper(g, p, ins * r, dels * r)
            worst = max(exact_g(score, e, p) for e in edits(WORDS, r, kind))
            assert worst <= bound + 1e-12, (name, r, worst, bound)


@pytest.mark.parametrize("p", [0.5, 0.9])
def test_each_bound_is_attained_by_some_score(p):
    """U is as tight as it can be: an inserted word that scores 1 when it survives reaches the insertion
    bound; a score that is 1 only without the deleted word reaches the deletion bound; a substitution
    that scores 1 when the new word survives and 0 when the old one does reaches the substitution bound."""
    base = lambda ws: 0.3
    ins = lambda ws: 1.0 if "X" in ws else base(ws)
    g = exact_g(ins, WORDS, p)
    assert exact_g(ins, WORDS + ["X"], p) == pytest.approx(certify.upper(g, p, 1, 0), abs=1e-12)
    gone = lambda ws: 0.0 if "travel" in ws else 1.0
    g = exact_g(gone, WORDS, p)
    assert exact_g(gone, WORDS[:-1], p) == pytest.approx(certify.upper(g, p, 0, 1), abs=1e-12)
    sub = lambda ws: 1.0 if "X" in ws else 0.0 if "travel" in ws else 0.5
    g = exact_g(sub, WORDS, p)
    assert exact_g(sub, WORDS[:-1] + ["X"], p) == pytest.approx(certify.upper(g, p, 1, 1), abs=1e-12)


def test_the_radius_is_the_largest_r_the_gap_covers():
    """Document 0 sits below four clearly better documents: certified exactly while U(ĝ + eps; r) stays
    under the third's lower bound, per kind; a document in the top k has no radius."""
    g = [0.10, 0.95, 0.94, 0.93, 0.92, 0.20]
    eps, p = 0.02, 0.9
    for kind, (i, d) in certify.KINDS.items():
        r = certify.radius(g, 0, 3, eps, p, kind, n_words=200)
        assert r is not None and r >= 1
        holds = lambda r: certify.upper(g[0] + eps, p, i * r, d * r) < g[3] - eps
        # a kind that deletes, certified at all 200 words the page has: every such edit it admits is covered
        assert holds(r) and not holds(r + 1) if r < 200 else d and r == certify.MAX_RADIUS and holds(200)
    assert certify.radius(g, 1, 3, eps, p, "inserted", 100) is None          # already in the top 3
    assert certify.radius(g, 0, 3, 0.5, p, "inserted", 100) is None          # too few samples to say anything
    assert certify.radius([0.1, 0.9], 0, 2, eps, p, "inserted", 100) is None  # a list of k: nothing to certify
    # a web-length page: p^r underflows to 0 past ~7,000 deleted words at 0.9, and the radius is still found
    assert certify.radius(g, 0, 3, eps, p, "deleted", 100_000) == certify.radius(g, 0, 3, eps, p, "deleted", 200)
    assert certify.upper(0.3, p, 0, 100_000) == 1.0
    # a 3-word page certified against deleting all its words: certified at every radius, not uncertified at 5
    assert certify.radius(g, 0, 3, eps, p, "deleted", 3) == certify.MAX_RADIUS


def test_a_clean_top_k_document_is_kept_while_the_attacked_one_cannot_reach_it():
    """j = 1 is third of the top 3; two documents are certifiably above it, so it keeps its place while
    an insertion into a = 0 cannot lift a to it; j = 3 is not certifiably in the top 3 at all."""
    g = [0.10, 0.60, 0.95, 0.94, 0.05]
    eps, p = 0.02, 0.9
    r = certify.kept_radius(g, 0, 1, 3, eps, p)
    assert certify.upper(g[0] + eps, p, r) < g[1] - eps <= certify.upper(g[0] + eps, p, r + 1)
    assert certify.kept_radius(g, 0, 2, 3, eps, p) == certify.MAX_RADIUS      # one above it: a cannot push it out
    assert certify.kept_radius([0.1, 0.5, 0.52, 0.51], 0, 1, 2, 0.02, p) is None


def lcs_dp(a, b):
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if x == y else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def test_the_bit_parallel_lcs_matches_the_dynamic_programme():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.choice("abcde") for _ in range(rng.randint(0, 70))]
        b = [rng.choice("abcdef") for _ in range(rng.randint(0, 70))]
        assert certify.lcs_length(a, b) == lcs_dp(a, b)
    assert certify.edit_counts("a b c d", "a x c d e") == (2, 1)      # b -> x (one of each), e inserted
    assert certify.edit_counts("a b c d", "a b c d") == (0, 0)


def test_a_rewrite_is_inside_exactly_when_the_general_bound_covers_its_edit():
    g, eps, p = [0.05, 0.95, 0.94, 0.93], 0.02, 0.95
    assert certify.inside(g, 0, 2, eps, p, 1, 0) and not certify.inside(g, 0, 2, eps, p, 100, 0)
    i = certify.radius(g, 0, 2, eps, p, "inserted", 50)
    assert certify.inside(g, 0, 2, eps, p, i, 0) and not certify.inside(g, 0, 2, eps, p, i + 1, 0)


def test_deletions_come_from_the_key_not_the_text():
    """Two texts of the same length under one key lose the same positions; another key, other positions;
    more samples extend the same ones (their scores cached)."""
    a = certify.deletions("one two three four five six seven eight", 0.5, 6, key="7:g1:3")
    b = certify.deletions("1 2 3 4 5 6 7 8", 0.5, 6, key="7:g1:3")
    pos = lambda text, kept: [i for i, w in enumerate(text.split()) if w in kept.split()]
    assert [pos("one two three four five six seven eight", x) for x in a] == [pos("1 2 3 4 5 6 7 8", x) for x in b]
    assert certify.deletions("1 2 3 4 5 6 7 8", 0.5, 8, key="7:g1:3")[:6] == b
    assert certify.deletions("1 2 3 4 5 6 7 8", 0.5, 6, key="8:g1:3") != b


def test_ndcg_is_one_for_the_same_top_k_and_less_for_another():
    assert certify.ndcg([3, 1, 2, 0], [3, 1, 2, 0], 2) == 1.0
    assert certify.ndcg([3, 1, 0, 2], [3, 1, 2, 0], 2) == 1.0                # below k does not count
    assert 0 < certify.ndcg([1, 3, 2, 0], [3, 1, 2, 0], 2) < 1
    assert certify.ndcg([0, 2, 1, 3], [3, 1, 2, 0], 2) == 0.0


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
                                  lambda: certify.upper(-0.1, 0.9, 1), lambda: certify.upper(0.5, 1.0, 1),
                                  lambda: certify.upper(float("nan"), 0.9, 1), lambda: certify.upper(0.5, 0.9, -1),
                                  lambda: defenses.keyword_certified(["the red fox"], -1),
                                  lambda: defenses.keyword_certified(["the red fox"], 1, alpha=float("nan")),
                                  lambda: defenses.keyword_certified(["the red fox"], 1.5)])
def test_the_certificates_refuse_inputs_outside_their_bounds(call):
    """alpha = nan, a negative score or corrupted count, a deletion rate of 1: each a ValueError naming the
    input, never a certificate computed from it (nan passes no comparison, so it would certify nothing
    silently or all)."""
    with pytest.raises(ValueError, match=r"(alpha|g|rate|inserted|n_docs|n_samples|corrupted) = "):
        call()


def test_a_groups_lists_draw_their_shared_documents_once(monkeypatch):
    """certify.smoothed takes the lists a group at a time: a benign document the group's lists share is drawn
    once (its samples keyed by group and position), and each list gets the mean over its own samples."""
    import types
    drawn = []
    real = certify.deletions
    monkeypatch.setattr(certify, "deletions", lambda d, rate, n, key: drawn.append(key) or real(d, rate, n, key))

    class Length:                                   # a stand-in ranker: a document's margin is its length
        def prepare(self, samples):
            pass

        def scores(self, x):
            return [len(d) / 100 for d in x.docs]
    benign = [f"benign page {i} " * 5 for i in range(4)]
    lists = [types.SimpleNamespace(group_id=g, query="q", docs=benign[:1] + [f"rewrite {g} {f} " * 5] + benign[1:])
             for g in ("g0", "g1") for f in range(3)]
    out = certify.smoothed(Length(), lists, 0.2, 8, 0)
    assert len(drawn) == 2 * (4 + 3) and len(set(drawn)) == 2 * 5       # per group: 4 shared + 3 rewrites
    for x, g in zip(lists, out):
        want = [sum(certify.sigmoid(len(s) / 100) for s in certify.deletions(d, 0.2, 8, f"0:{x.group_id}:{j}")) / 8
                for j, d in enumerate(x.docs)]
        assert g == pytest.approx(want)
