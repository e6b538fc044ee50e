"""endpoints.py: a URL parsed once, its credentials held apart and never printed; cache identities;
redact_url for text that does not parse.
Vendors with: endpoints.py (no torch)
Run: python -m pytest -q test_endpoints.py
"""
import pytest

from endpoints import Endpoint, SearchSpec, parse_rerankers, parse_spec, redact, redact_url


def test_parse_keeps_credentials_apart_from_the_url_it_prints():
    e = Endpoint.parse("http://usr:pw@127.0.0.1:8802/v1/rerank#m")
    assert (e.url, e.model, e.basic) == ("http://127.0.0.1:8802/v1/rerank", "m", ("usr", "pw"))
    assert str(e) == f"{e}" == "http://***@127.0.0.1:8802/v1/rerank#m"
    assert "pw" not in repr(e) and "pw" not in str(e.with_path("/v1/x")) and e.with_path("/v1/x").basic == e.basic


def test_identity_tells_servers_apart_by_their_address_never_credentials():
    a = Endpoint.parse("http://alice:one@127.0.0.1:8000/v1")
    assert a == Endpoint.parse("http://bob:two@127.0.0.1:8000/v1") and a.identity == "http://127.0.0.1:8000/v1"
    others = ["http://127.0.0.1:8001/v1", "http://127.0.0.1:8000/v2", "https://127.0.0.1:8000/v1"]
    assert all(Endpoint.parse(u).identity != a.identity for u in others)
    assert Endpoint.parse("https://api.example.com/v1/").identity == "https://api.example.com:443/v1"
    assert Endpoint.parse("https://api.example.com/v1/").url == "https://api.example.com/v1"   # default port left out
    assert Endpoint.parse("http://[::1]:8080/v1").url == "http://[::1]:8080/v1"


@pytest.mark.parametrize("url,msg", [("ftp://h/x", "expected http"), ("", "expected http"),
                                     ("http://h:99999/v1", "port"), ("http://u:s3cr@h:xx/v1", "port"),
                                     ("http://u:s3/cr@host/v1", "percent-encode")])
def test_a_malformed_url_is_refused_without_its_credentials(url, msg):
    with pytest.raises(ValueError, match=msg) as e:
        Endpoint.parse(url)
    assert "s3" not in str(e.value)


def test_vllms_score_api_is_a_spec_of_its_own():
    """vllm-score:URL[#MODEL]: vLLM's /score under the URL's path, its model kept, printed as given."""
    s = parse_spec("vllm-score:http://u:S3cret@127.0.0.1:8000#shield")
    assert (s.kind, s.model, s.endpoint.path, str(s)) == ("vllm-score", "shield", "/score",
                                                          "vllm-score:http://***@127.0.0.1:8000/score#shield")
    assert parse_spec("vllm-score:http://h:1/v1").endpoint.path == "/v1/score"


def test_redact_url_hides_everything_up_to_the_last_at():
    assert redact_url("http://user:p#w@host/v1") == "http://***@host/v1"
    assert redact_url("tei:http://a:b@h/x") == "tei:http://***@h/x"
    assert redact_url("co=http://u:p@w@h/v1") == "co=http://***@h/v1"
    assert [redact_url(t) for t in ("cohere:m", "http://h/v1", None)] == ["cohere:m", "http://h/v1", None]


def test_redact_finds_a_url_whose_password_holds_a_quote():
    """A quote is legal unencoded in userinfo (RFC 3986 3.2.1): a URL in free text runs to white space."""
    for url in ("http://u:p'S3cret@h/x", 'http://u:p"S3cret@h:1/v1'):
        host = url.split("@")[1]
        assert redact(f"error: --reranker '{url}' refused") == f"error: --reranker 'http://***@{host}' refused"


@pytest.mark.parametrize("text,shown", [("usr:S3cret@127.0.0.1:1/v1", "***@127.0.0.1:1/v1"),
                                        ("http:/usr:S3cret@127.0.0.1:1/v1", "http:/***@127.0.0.1:1/v1"),
                                        ("http//usr:S3cret@127.0.0.1:1/v1", "http//***@127.0.0.1:1/v1"),
                                        ("tei:usr:S3cret@h:1", "tei:***@h:1"), ("S3cret@h", "***@h"),
                                        ("vllm-score:usr:S3cret@h:1", "vllm-score:***@h:1"),
                                        ("usr:p://S3cret@h", "***@h"),
                                        ("http://h:xx/v1?api_key=S3cret", "http://h:xx/v1?***")])
def test_redact_url_hides_userinfo_without_a_scheme_and_queries(text, shown):
    assert redact_url(text) == shown


@pytest.mark.parametrize("parse,text", [(Endpoint.parse, "usr:S3cret@127.0.0.1:1/v1"),
                                        (Endpoint.parse, "http:/usr:S3cret@127.0.0.1:1/v1"),
                                        (Endpoint.parse, "http//usr:S3cret@127.0.0.1:1/v1"),
                                        (Endpoint.parse, "http://127.0.0.1:xx/v1?token=S3cret"),
                                        (parse_spec, "usr:S3cret@127.0.0.1:1/v1"),
                                        (parse_spec, "tei:usr:S3cret@127.0.0.1:1"),
                                        (SearchSpec.parse, "tavily:usr:S3cret@127.0.0.1:1"),
                                        (SearchSpec.parse, "usr:p@ssS3cret@127.0.0.1:1"),
                                        (parse_rerankers, ["usr:S3cret@x=base"])])
def test_a_spec_that_does_not_parse_is_refused_without_its_credentials(parse, text):
    with pytest.raises(ValueError) as e:
        parse(text)
    assert "S3cret" not in str(e.value) and "***" in str(e.value)
