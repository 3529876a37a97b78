import itertools

from hypothesis import given
from hypothesis import strategies as st

from agentkv.engine.stopping import StopStrings


def run(stops, chunks):
    matcher = StopStrings(stops)
    out = []
    for chunk in chunks:
        text, hit = matcher.feed(chunk)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


def test_stop_split_across_deltas_is_held_back_then_dropped():
    matcher = StopStrings(["</end>"])
    assert matcher.feed("hello </") == ("hello ", False)
    assert matcher.feed("en") == ("", False)
    assert matcher.feed("d> tail") == ("", True)


def test_false_alarm_is_released():
    matcher = StopStrings(["STOP"])
    assert matcher.feed("ST") == ("", False)
    assert matcher.feed("AR") == ("STAR", False)
    assert matcher.flush() == ""


def test_earliest_of_several_stops_wins():
    assert run(["bbb", "a"], ["xxbbbxa"]) == ("xx", True)
    matcher = StopStrings(["bbb", "a"])
    matcher.feed("xxbbbxa")
    assert matcher.matched == "bbb"


def test_no_stops_passes_through():
    assert run([], ["a", "b"]) == ("ab", False)
    assert run([""], ["a"]) == ("a", False)


@given(
    text=st.text(alphabet="abc", max_size=40),
    stop=st.text(alphabet="abc", min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_any_chunking_matches_str_find(text, stop, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[a:b] for a, b in itertools.pairwise(bounds)]
    cut = text.find(stop)
    expected = (text[:cut], True) if cut >= 0 else (text, False)
    assert run([stop], chunks) == expected
