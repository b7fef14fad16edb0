from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from sieproxy.core.shaping.stopstr import StopMatcher


def reference(text: str, stops: list[str]) -> tuple[str, bool]:
    """Brute force: the first stop to complete as the text grows, longest on a tie."""
    stops = [s for s in stops if s]
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if end >= len(s) and text[end - len(s) : end] == s]
        if hits:
            longest = max(hits, key=len)
            return text[: end - len(longest)], True
    return text, False


def run(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    m = StopMatcher(stops)
    out = []
    matched = False
    for p in pieces:
        safe, hit = m.feed(p)
        out.append(safe)
        if hit:
            matched = True
        else:
            assert not matched, "matched must stay true"
    if not matched:
        out.append(m.flush())
    else:
        assert m.flush() == ""
    return "".join(out), matched


def splits(text: str, max_cuts: int) -> list[list[str]]:
    result = []
    for k in range(min(max_cuts, max(len(text) - 1, 0)) + 1):
        for cuts in itertools.combinations(range(1, len(text)), k):
            bounds = (0, *cuts, len(text))
            result.append([text[a:b] for a, b in itertools.pairwise(bounds)])
    return result


OVERLAPPING = ["ab", "abc", "bcd"]
TEXTS = [
    "",
    "a",
    "xxabc",
    "xxbcdab",
    "xabxx",
    "xbcdx",
    "aabcd",
    "abab",
    "bcbcd",
    "xxxxxxxx",
    "xbxcxdxa",
    "zzzab",
    "zza",
    "zzbc",
]


def test_overlapping_stops_every_split() -> None:
    for text in TEXTS:
        expected = reference(text, OVERLAPPING)
        for pieces in splits(text, 3):
            assert run(pieces, OVERLAPPING) == expected, (text, pieces)


def test_nested_stops_every_split() -> None:
    stops = ["abc", "b", "\u2028x", "\U0001f600\U0001f600!"]
    texts = ["xabc", "xab", "a\u2028x", "\U0001f600\U0001f600\U0001f600!", "ac", "q\u2028"]
    for text in texts:
        expected = reference(text, stops)
        for pieces in splits(text, 3):
            assert run(pieces, stops) == expected, (text, pieces)


def test_first_to_complete_wins_over_earlier_start() -> None:
    # "abc" starts earlier but "b" completes first.
    assert run(["abc"], ["abc", "b"]) == ("a", True)
    assert run(["a", "b", "c"], ["abc", "b"]) == ("a", True)


def test_holds_back_prefix_and_releases_on_flush() -> None:
    m = StopMatcher(["###"])
    assert m.feed("hello #") == ("hello ", False)
    assert m.held == "#"
    assert m.feed("#") == ("", False)
    assert m.feed("x") == ("##x", False)
    assert m.feed("##") == ("", False)
    assert m.flush() == "##"


def test_after_match_everything_is_dropped() -> None:
    m = StopMatcher(["stop"])
    assert m.feed("go stop now") == ("go ", True)
    assert m.matched == "stop"
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_no_stops_passes_through() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)
    assert m.flush() == ""
    m2 = StopMatcher([""])
    assert m2.feed("abc") == ("abc", False)


_alpha = st.text(alphabet="abcd\u2028", max_size=14)


@given(
    text=_alpha,
    stops=st.lists(st.text(alphabet="abcd\u2028", min_size=1, max_size=4), max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=14), max_size=6),
)
def test_property_any_split_matches_reference(text: str, stops: list[str], cuts: list[int]) -> None:
    points = sorted({c for c in cuts if 0 < c < len(text)})
    bounds = (0, *points, len(text))
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
    assert run(pieces, stops) == reference(text, stops)


@given(text=_alpha, stops=st.lists(st.text(alphabet="abcd", min_size=1, max_size=4), max_size=3))
def test_property_emitted_text_never_contains_a_stop(text: str, stops: list[str]) -> None:
    m = StopMatcher(stops)
    emitted = ""
    for ch in text:
        safe, hit = m.feed(ch)
        emitted += safe
        assert not any(s in emitted for s in stops)
        if hit:
            break
