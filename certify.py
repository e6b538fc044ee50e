"""A certificate for a reranker's top-k under word edits: randomized masking (rerank-eval --certify).

Measured robustness says how often attacks got through; a certificate says which attacked documents no
edit of a given size can bring into the top k. This is the randomized-masking certificate of RanMASK
(Zeng et al., Computational Linguistics 49(2), 2023) as RobustMask (arXiv 2512.23307) carries it to
neural rankers, on a cross-encoder's sigmoid score. (CertDR, arXiv 2209.06691, certifies rankers by
smoothing over synonym substitutions, not masks.)

Smoothing. A document of n words is scored on random masks that keep h = n - round(rate * n) of its
words (in order; the rest deleted) and the sigmoid of the reranker's margin is averaged:
    g(q, d) = E_mask[ sigmoid(m(q, mask(d))) ]  in [0, 1],
estimated by the mean ĝ over N masks (--samples); the smoothed ranking orders a list by ĝ.

The bound. Let d' differ from d in at most e substituted words, e = ceil(p * n). A mask that keeps none
of the e positions shows d and d' the same words, so the two expectations differ only on the masks that
keep one; those have probability
    Δ(p) = 1 - C(n - e, h) / C(n, h)
and each changes the score by at most 1 (scores lie in [0, 1]). Hence |g(q, d') - g(q, d)| <= Δ(p).
Monte Carlo: by Hoeffding, |ĝ - g| <= eps = sqrt(ln(2 D / alpha) / (2 N)) for every one of a list's D
documents at once with probability >= 1 - alpha (a union bound over the D documents).
Certificate for the attacked document a of a list: with the other documents unchanged, it stays out of
the smoothed top k under every edit of at most a fraction p of its words when
    ĝ_a + eps + Δ(p) < the k-th largest of {ĝ_j - eps : j != a},
since then k other documents score above every g(q, d'_a). The certified radius of a is the largest p
of the grid (5, 10, 20, 30%) for which this holds, 0 when none does.

What it does not cover: the bound is for substitutions. A rewrite that inserts or deletes words (almost
every GEO rewrite: they add claims, lists and summaries) changes n and every later word's position, so
`edit_fraction` (word-level Levenshtein distance over the source's words) only compares the real
rewrites' size with the certified radius; most GEO rewrites touch far more than 30% of a document.
Randomized deletion (CERT-ED, arXiv 2408.00728) certifies edit distance and would cover them; it is
not implemented here.

Smoothed scores go through rankers.Ranker's disk cache like every score, so a rerun costs nothing and
an interrupted one resumes; the masks of a document depend only on its text, the seed and the sample
index, so a larger --samples reuses the smaller one's scores.

Usage: python run.py rerank-eval --name demo --reranker base --reranker shield --certify --samples 32
"""
import hashlib
import math
import random

from metrics import sigmoid

GRID = (0.05, 0.10, 0.20, 0.30)      # edit fractions p at which the certificate is reported
ALPHA = 0.05                          # 1 - confidence of every list's certificate


def masks(text, rate, n, seed):
    """n masked copies of `text`, each keeping h = len - round(rate * len) of its words (at least one), in
    order. Seeded by the text itself: a document shared by several lists gets the same masks in each."""
    words = text.split()
    keep = max(1, len(words) - round(rate * len(words)))
    digest = hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]
    out = []
    for s in range(n):
        rng = random.Random(f"{seed}:{digest}:{s}")
        out.append(" ".join(words[i] for i in sorted(rng.sample(range(len(words)), keep))))
    return out


def check_unit(name, v, lo_open=False, hi_open=False):
    """A probability or fraction in [0, 1] (ends open where asked) -> v; ValueError naming it otherwise (nan
    included: every comparison with nan is false, so it would pass a plain `0 <= v <= 1` written as two `<`)."""
    if not (isinstance(v, (int, float)) and math.isfinite(v) and (0 < v if lo_open else 0 <= v)
            and (v < 1 if hi_open else v <= 1)):
        raise ValueError(f"{name} = {v!r}: not in {'(' if lo_open else '['}0, 1{')' if hi_open else ']'}")
    return v


def check_count(name, v, lo=0):
    """A whole count >= lo -> v; ValueError naming it otherwise."""
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} = {v!r}: not a whole number >= {lo}")
    return v


def delta(n_words, p, rate):
    """Δ(p): the probability that a mask keeps one of ceil(p * n) edited words (module docstring)."""
    check_count("n_words", n_words, 1), check_unit("p", p), check_unit("rate", rate, lo_open=True, hi_open=True)
    keep = max(1, n_words - round(rate * n_words))
    e = math.ceil(p * n_words)
    if n_words - e < keep:
        return 1.0
    return 1.0 - math.comb(n_words - e, keep) / math.comb(n_words, keep)


def epsilon(n_docs, n_samples, alpha=ALPHA):
    """Hoeffding's half-width for every one of a list's n_docs smoothed scores at once (union bound)."""
    check_count("n_docs", n_docs, 1), check_count("n_samples", n_samples, 1)
    check_unit("alpha", alpha, lo_open=True, hi_open=True)
    return math.sqrt(math.log(2 * n_docs / alpha) / (2 * n_samples))


def certified_radius(g, a, n_words, k, eps, rate, grid=GRID):
    """The largest p of `grid` at which document a of a list with smoothed scores g stays out of the top k
    under every edit of at most p of its n_words words (module docstring), 0.0 when none."""
    others = sorted((g[j] - eps for j in range(len(g)) if j != a), reverse=True)
    if len(others) < k:
        return 0.0
    ok = [p for p in grid if g[a] + eps + delta(n_words, p, rate) < others[k - 1]]
    return max(ok, default=0.0)


MAX_EDIT_WORDS = 2000                 # edit_fraction compares at most this many words of each text


def edit_fraction(source, rewrite):
    """Word-level Levenshtein distance from source to rewrite over the source's words (insertions,
    deletions and substitutions each count one). Both texts are untrusted and the distance is quadratic,
    so it is taken over their first MAX_EDIT_WORDS words (4M cells at most: a second or two)."""
    a, b = source.split()[:MAX_EDIT_WORDS], rewrite.split()[:MAX_EDIT_WORDS]
    prev = list(range(len(b) + 1))
    for i, wa in enumerate(a, 1):
        cur = [i]
        for j, wb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (wa != wb)))
        prev = cur
    return prev[-1] / max(1, len(a))


class Masked:
    """A list as one mask sample sees it (rankers.Ranker scores any object with .query and .docs)."""

    def __init__(self, query, docs):
        self.query, self.docs = query, docs


def smoothed(ranker, lists, rate, n, seed):
    """ĝ of every document of `lists` (objects with .query and .docs) under `ranker` (rankers.Ranker,
    scores cached) -> [[ĝ per document] per list]: the mean over n masks of sigmoid(margin)."""
    per = [[masks(d, rate, n, seed) for d in x.docs] for x in lists]        # (lists, D, n) masked texts
    samples = [Masked(x.query, [m[s] for m in ms]) for x, ms in zip(lists, per) for s in range(n)]
    ranker.prepare(samples)
    out = []
    for i, x in enumerate(lists):
        scores = [ranker.scores(samples[i * n + s]) for s in range(n)]      # (n, D) margins
        out.append([sum(sigmoid(row[j]) for row in scores) / n for j in range(len(x.docs))])
    return out
