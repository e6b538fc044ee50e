"""accounting.py: one price key and one token formula, batch rows at the batch share, rerank prices,
the usage ledger summed per stage and model.
Vendors with: accounting.py (no torch)
Run: python -m pytest -q test_accounting.py
"""
import json

import pytest

from accounting import append_ledger, ledger_usage, price_key, price_of, token_cost


def test_price_key_is_the_model_name_after_the_provider():
    labels = ("ollama:qwen3:8b", "openai:gpt-5.5 [batch]", "rerank:cohere:rerank-v3.5", "search:tavily")
    assert [price_key(x) for x in labels] == ["qwen3:8b", "gpt-5.5", "rerank-v3.5", "tavily"]


def test_a_batch_row_costs_the_batch_share_of_the_full_price():
    row = {"prompt_tokens": 10 ** 6, "completion_tokens": 10 ** 6, "replies": 3}
    assert price_of("openai:gpt-5.5", row, {"gpt-5.5": [1.0, 2.0]}) == token_cost([1.0, 2.0], row) == 3.0
    assert price_of("openai:gpt-5.5 [batch]", row, {"gpt-5.5": [1.0, 2.0]}) == 1.5            # half by default
    assert price_of("openai:gpt-5.5 [batch]", row, {"gpt-5.5": [1.0, 2.0, 0.25]}) == 0.75     # a third number
    assert price_of("openai:gpt-5.5", row, {"other": [1.0, 2.0]}) is None


def test_rerank_rows_are_priced_per_search_unit_or_per_token():
    row = {"replies": 4, "search_units": 2, "tokens": 10 ** 6}
    assert price_of("rerank:cohere:rerank-v3.5", row, {"rerank-v3.5": {"usd_per_1k_searches": 2.0}}) == 0.004
    assert price_of("rerank:cohere:rerank-v3.5", {"replies": 4}, {"rerank-v3.5": {"usd_per_1k_searches": 2.0}}) \
        == 0.008                                                                     # one search unit a request
    assert price_of("rerank:jina:m", row, {"m": {"usd_per_1m_tokens": 0.5}}) == 0.5



def test_a_price_of_another_kind_is_unknown_not_zero():
    """A chat model priced per rerank token, a rerank endpoint priced as a chat model, a token price for an
    endpoint that reports no tokens: the cost is unknown (None), not $0."""
    chat = {"replies": 1, "prompt_tokens": 10 ** 6, "completion_tokens": 10 ** 6}
    rerank = {"replies": 4, "search_units": 4}
    assert price_of("openai:gpt-5.5", chat, {"gpt-5.5": {"usd_per_1m_tokens": 5}}) is None
    assert price_of("rerank:cohere:rerank-v3.5", rerank, {"rerank-v3.5": [2.0, 0]}) is None
    assert price_of("rerank:cohere:rerank-v3.5", rerank, {"rerank-v3.5": {"usd_per_1m_tokens": 1}}) is None


def _ledger(tmp_path):
    """A ledger of four replies: three of one model in two stages, one of another model."""
    path = str(tmp_path / "usage.jsonl")
    for stage in ("eval", "eval", "train"):
        append_ledger(path, {"stage": stage, "model": "ollama:qwen3:8b", "prompt_tokens": 10, "completion_tokens": 5})
    append_ledger(path, {"stage": "eval", "model": "offline:offline-engine", "prompt_tokens": 1})
    return path


def test_a_line_cut_by_a_kill_is_skipped_by_the_ledger(tmp_path):
    path = _ledger(tmp_path)
    whole = ledger_usage(path, {"qwen3:8b": [1.0, 2.0]})
    with open(path, "a") as f:
        f.write(json.dumps({"stage": "eval", "model": "x"})[:10])                  # a kill mid-line
    u = ledger_usage(path, {"qwen3:8b": [1.0, 2.0]})
    assert u == whole and u["total"]["replies"] == 4
    # the rerun's next reply is not glued onto the cut line (it would go unread: that reply is cached, never
    # asked again, and its cost lost for good)
    append_ledger(path, {"stage": "eval", "model": "offline:offline-engine", "prompt_tokens": 1})
    assert ledger_usage(path, {})["total"]["replies"] == 5
    with open(path, "a") as f:          # a line no writer wrote (an edit by hand): skipped, not a crash
        f.write("[1, 2]\n12\n")
    assert ledger_usage(path, {})["total"]["replies"] == 5
    with open(path, "ab") as f:         # a damaged byte (a bad disk): that line skipped, not every command's end
        f.write(b'{"stage": "eval", "model": "x\xff"}\n')
    assert ledger_usage(path, {})["total"]["replies"] == 5


def test_the_ledger_sums_each_model_within_each_stage(tmp_path):
    path = _ledger(tmp_path)
    u = ledger_usage(path, {"qwen3:8b": [1.0, 2.0]})
    assert u["stages"]["eval"]["ollama:qwen3:8b"] == {"replies": 2, "prompt_tokens": 20, "completion_tokens": 10,
                                                      "cost_usd": pytest.approx(40e-6)}
    assert u["stages"]["eval"]["offline:offline-engine"]["cost_usd"] is None
    assert u["total"]["replies"] == 4 and u["total"]["prompt_tokens"] == 31 and u["total"]["cost_usd"] is None
    assert ledger_usage(path, {"qwen3:8b": [1.0, 2.0], "offline-engine": [0.0, 0.0]})["total"]["cost_usd"] == \
        pytest.approx(60e-6)
