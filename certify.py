"""A certificate for a reranker's top-k under word edits: randomized deletion (rerank-eval --certify).

Measured robustness says how often attacks got through; a certificate says which attacked documents no
edit of a given size can bring into the top k. GEO's strongest moves are short insertions (a statistic,
a quotation, an authority's name: GEO, arXiv 2311.09735), so the certificate is in inserted, deleted and
substituted words, after randomized deletion (RS-Del, Huang et al., NeurIPS 2023, arXiv 2302.01757;
CERT-ED, arXiv 2408.00728 carries it to edit distance), on a cross-encoder's sigmoid score.

Smoothing. Each word of a document d is deleted independently with probability p (--deletion-rate);
δ(d) is what is left, in order (possibly nothing). The smoothed score is
    g(q, d) = E_δ[ sigmoid(m(q, δ(d))) ]  in [0, 1],
estimated by the mean ĝ over N deletion samples (--certify-samples); the smoothed ranking orders a list by ĝ.

The bound (a coupling; the proof of RS-Del's Theorem, written for a bounded score). Let d' come from d by
deleting r_d of d's words and inserting r_i new ones, so that the words they share, z, form a common
subsequence of n - r_d words (a substitution is one deletion and one insertion). Run the deletion on d:
with probability p^{r_d} it deletes every word of d outside z, and then what is left is distributed
exactly as δ(z). So
    g(d)  = p^{r_d} g(z) + (1 - p^{r_d}) B,     g(d') = p^{r_i} g(z) + (1 - p^{r_i}) B'
for some B, B' in [0, 1]. The first gives g(z) <= min(1, g(d) / p^{r_d}); the second, B' <= 1:
    g(d') <= U(g(d); r_i, r_d) = p^{r_i} min(1, g(d) / p^{r_d}) + 1 - p^{r_i}.
Per kind of edit of r words:
    inserted     U = 1 - p^r (1 - g)            (r_i = r, r_d = 0)
    deleted      U = min(1, g / p^r)            (r_i = 0, r_d = r)
    substituted  U = min(1, g + 1 - p^r)        (r_i = r_d = r; as tight as this coupling gets)
Each is attained by some score (test_certify enumerates every deletion pattern of small cases): an
inserted word that sets the score to 1 when it survives gives the first with equality.

Monte Carlo. By Hoeffding, |ĝ - g| <= eps = sqrt(ln(2 D / alpha) / (2 N)) for every one of a list's D
documents at once with probability >= 1 - alpha (a union bound over the D documents, two-sided).

Certificate for an attacked document a of a list, the others unchanged: no edit of r words of a kind
brings a into the smoothed top k when
    U(ĝ_a + eps; r) < the k-th largest of {ĝ_j - eps : j != a},
since then k other documents score above every g(q, d'_a). Its radius is the largest such r (None when
a is not certifiably outside the top k even unedited). Symmetrically, a clean top-k document j keeps its
place against every insertion of r words into a when fewer than k documents can score above it: the
others that can score above its lower bound (ĝ_i + eps >= ĝ_j - eps), plus a if U(ĝ_a + eps; r) reaches it.
Where the attacker writes further documents of the list too (a list with several attacked, --attacked K),
their scores are the attacker's to raise or lower: the k-th largest is taken over the documents no one
attacked (`skip`), and each of them counts above a clean j.

A real rewrite is inside its source's certificate when its own edit, r_i inserted and r_d deleted
words from a longest common subsequence (edit_counts), satisfies the general bound U(ĝ + eps; r_i, r_d).

Randomness. The deletions of rerank-eval come from a seed drawn once per run from the OS (kept in the
run's cache/noise_seed.json, so a resumed run reuses its scores), the group and the document's position,
never from the text: with a public seed an attacker could search offline for a rewrite whose deletions
fall luckily. `serve --smooth N` draws fresh deletions for every request from the OS's CSPRNG.
What is certified is the ideal smoothed ranker g (the expectation over deletions), with either seed: the
bound says nothing of a Monte Carlo estimate ĝ(d') of an edited page, which a deployed ranker computes from
its own N samples (standard error about 0.5/sqrt(N)), so a certified page whose bound clears the k-th score
by less than that can still reach a served top k. A statement about the deployed ranking needs a margin for
that noise (as Cohen et al. 2019's PREDICT abstains) or a bound on ĝ(d') from its own samples.

Usage: python run.py rerank-eval --name demo --reranker base --reranker shield --certify
"""
import math
import random
import secrets

from metrics import sigmoid

RADII = (1, 2, 5, 10, 20)              # edit sizes in words at which the certificate is reported
KINDS = {"inserted": (1, 0), "deleted": (0, 1), "substituted": (1, 1)}    # words (inserted, deleted) per word
ALPHA = 0.05                           # 1 - confidence of every list's certificate
MAX_RADIUS = 10_000                    # the largest radius searched, in words


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


# ----------------------------------------------------------------------------- the noise


def delete_words(text, rate, rng):
    """δ(text): each word deleted independently with probability `rate` (rng: random.Random or SystemRandom)."""
    return " ".join(w for w in text.split() if rng.random() >= rate)


def deletions(text, rate, n, key):
    """n deletion samples of `text`, sample s drawn from the stream (key, s): a larger n extends the same
    samples (their scores cached)."""
    return [delete_words(text, rate, random.Random(f"{key}:{s}")) for s in range(n)]


def smoothed_margins(m, n):
    """The n samples' margins of each document, document by document -> the margin logit(ĝ) of its smoothed
    score ĝ, the mean sigmoid, so that sigmoid of it (a served relevance score) is ĝ itself."""
    g = [sum(map(sigmoid, m[i:i + n])) / n for i in range(0, len(m), n)]
    return [math.log(x / (1 - x)) for x in (min(max(x, 1e-12), 1 - 1e-12) for x in g)]


def fresh_seed():
    """A run's deletion seed, from the OS's CSPRNG (never from the text or the public --seed)."""
    return secrets.randbits(63)


# ----------------------------------------------------------------------------- the bound


def upper(g, rate, inserted=0, deleted=0):
    """U(g; r_i, r_d): the largest smoothed score a document of smoothed score g can reach after
    `inserted` words are inserted and `deleted` deleted (module docstring)."""
    check_unit("g", g), check_unit("rate", rate, lo_open=True, hi_open=True)
    check_count("inserted", inserted), check_count("deleted", deleted)
    kept = rate ** deleted                  # 0.0 past ~7,000 deleted words at 0.9: min(1, g / p^r_d) is then 1
    return rate ** inserted * (1.0 if kept <= g else g / kept) + 1.0 - rate ** inserted


def epsilon(n_docs, n_samples, alpha=ALPHA):
    """Hoeffding's half-width for every one of a list's n_docs smoothed scores at once (union bound)."""
    check_count("n_docs", n_docs, 1), check_count("n_samples", n_samples, 1)
    check_unit("alpha", alpha, lo_open=True, hi_open=True)
    return math.sqrt(math.log(2 * n_docs / alpha) / (2 * n_samples))


def kth_lower(g, skip, k, eps):
    """The k-th largest lower bound ĝ_j - eps over the documents j not in `skip`; None when fewer than k."""
    lows = sorted((g[j] - eps for j in range(len(g)) if j not in skip), reverse=True)
    return lows[k - 1] if len(lows) >= k else None


def largest(holds, cap):
    """The largest r in [0, cap] with holds(r), for holds true up to some r and false after; None if not at 0."""
    if not holds(0):
        return None
    lo, hi = 0, cap                              # holds(lo); bisection on a monotone predicate
    if holds(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if holds(mid) else (lo, mid)
    return lo


def radius(g, a, k, eps, rate, kind, n_words, skip=()):
    """The largest r such that no edit of r words of `kind` (KINDS) brings document a of a list with smoothed
    scores g into the smoothed top k (module docstring); None when a is not certifiably outside it. An edit
    that deletes words has at most a's n_words to delete: certified at n_words, a is certified against every
    edit of that kind it admits, so the radius is MAX_RADIUS (a short page is not reported uncertified at r =
    20 for edits it cannot undergo). skip: the list's other attacked documents, which set no bar."""
    bar = kth_lower(g, {a, *skip}, k, eps)
    if bar is None:
        return None
    ins, dels = KINDS[kind]
    top = min(1.0, g[a] + eps)
    cap = MAX_RADIUS if dels == 0 else n_words                 # no more words can go than a has
    r = largest(lambda r: upper(top, rate, ins * r, dels * r) < bar, cap)
    return MAX_RADIUS if dels and r == n_words else r


def kept_radius(g, a, j, k, eps, rate, skip=()):
    """The largest r such that the top-k document j keeps its place against every insertion of r words into
    document a (module docstring); MAX_RADIUS when j stays in the top k even with a above it, None when j is
    not certifiably in. skip: the list's other attacked documents, each counted above j."""
    above = sum(g[i] + eps >= g[j] - eps or i in skip for i in range(len(g)) if i not in (a, j))
    if above >= k:
        return None
    if above + 1 < k:                            # even above j, a leaves j inside the top k
        return MAX_RADIUS
    top = min(1.0, g[a] + eps)
    return largest(lambda r: upper(top, rate, r) < g[j] - eps, MAX_RADIUS)


def inside(g, a, k, eps, rate, inserted, deleted, skip=()):
    """Whether an edit of `inserted` and `deleted` words of document a is covered by its certificate (skip:
    as radius's)."""
    bar = kth_lower(g, {a, *skip}, k, eps)
    return bar is not None and upper(min(1.0, g[a] + eps), rate, inserted, deleted) < bar


def lcs_length(a, b):
    """Length of a longest common subsequence of the word lists a and b, by the bit-parallel algorithm of
    Crochemore et al. (Inf. Process. Lett. 80, 2001): one bit a word of `a`, one big-int step a word of
    `b`, so web-length pages take milliseconds (the plain dynamic programme: test_certify)."""
    occurs = {}
    for i, w in enumerate(a):
        occurs[w] = occurs.get(w, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full
    for w in b:
        u = v & occurs.get(w, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - bin(v).count("1")


def edit_counts(source, rewrite):
    """(inserted, deleted) words from source to rewrite along a longest common subsequence: the fewest
    insertions and deletions that make one the other (a substitution counts one of each)."""
    a, b = source.split(), rewrite.split()
    common = lcs_length(a, b)
    return len(b) - common, len(a) - common


def ndcg(order, reference, k):
    """nDCG@k of `order` against the `reference` order of the same list: the reference's i-th document
    has gain k - i within its top k, 0 below (1.0: the same top k in the same order)."""
    gain = {d: k - i for i, d in enumerate(reference[:k])}
    dcg = lambda o: sum(gain.get(d, 0) / math.log2(i + 2) for i, d in enumerate(o[:k]))
    return dcg(order) / dcg(reference)


# ----------------------------------------------------------------------------- scoring


class Noised:
    """A list as one deletion sample sees it (rankers.Ranker scores any object with .query and .docs)."""

    def __init__(self, query, docs):
        self.query, self.docs = query, docs


def smoothed(ranker, lists, rate, n, seed):
    """ĝ of every document of `lists` (objects with .query, .group_id and .docs) under `ranker`
    (rankers.Ranker, scores cached) -> [[ĝ per document] per list]: the mean over n deletion samples of
    sigmoid(margin). A document's samples are keyed by the seed, its group and its position, so the benign
    documents a group's lists share are drawn and scored once (each document's samples stay independent
    draws). The lists go a group at a time: memory holds one group's samples, not every list's (at web
    length and the default n, millions of texts)."""
    groups = {}
    for i, x in enumerate(lists):
        groups.setdefault(x.group_id, []).append(i)
    out = [None] * len(lists)
    for idx in groups.values():
        drawn = {}                                                           # (key, text) -> its n samples

        def draw(x, j, d):                     # document j of list x: its n samples, drawn once in the group
            key = f"{seed}:{x.group_id}:{j}"
            if (key, d) not in drawn:
                drawn[key, d] = deletions(d, rate, n, key)
            return drawn[key, d]
        per = [[draw(lists[i], j, d) for j, d in enumerate(lists[i].docs)] for i in idx]   # (lists, D, n) texts
        samples = [Noised(lists[i].query, [m[s] for m in ms]) for i, ms in zip(idx, per) for s in range(n)]
        ranker.prepare(samples)
        for k, i in enumerate(idx):
            scores = [ranker.scores(samples[k * n + s]) for s in range(n)]  # (n, D) margins
            out[i] = [sum(sigmoid(row[j]) for row in scores) / n for j in range(len(lists[i].docs))]
    return out
