"""Stop strings: never emitted, text before them is, partial matches are held back."""

from __future__ import annotations

from workers.engine.stopping import StopStrings


def feed(stop: StopStrings, deltas: list[str]) -> tuple[str, bool]:
    out = []
    for delta in deltas:
        text, hit = stop.push(delta)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + stop.flush(), False


def test_stop_string_inside_one_delta_cuts_before_it() -> None:
    assert feed(StopStrings(["END"]), ["abc", "xENDyz"]) == ("abcx", True)


def test_stop_string_split_across_deltas_is_never_emitted() -> None:
    stop = StopStrings(["END"])
    assert stop.push("abE") == ("ab", False)
    assert stop.push("N") == ("", False)
    assert stop.push("D!") == ("", True)


def test_held_text_is_released_when_it_stops_matching() -> None:
    stop = StopStrings(["END"])
    assert stop.push("xEN") == ("x", False)
    assert stop.push("o") == ("ENo", False)


def test_earliest_of_several_stop_strings_wins() -> None:
    stop = StopStrings(["b", "zz"])
    assert feed(stop, ["azzb"]) == ("a", True) and stop.matched == "zz"  # vLLM's stop_reason


def test_held_text_is_flushed_at_the_end() -> None:
    assert feed(StopStrings(["END"]), ["ok E"]) == ("ok E", False)


def test_no_stop_strings_passes_text_through() -> None:
    assert StopStrings([]).push("anything") == ("anything", False)


def test_before_min_tokens_nothing_stops_but_a_stop_string_may_begin_there() -> None:
    """vLLM checks stop strings from min_tokens on, looking back as far as a stop string reaches: one
    that begins before the boundary and ends after it stops the output; one that ends before does not."""
    stop = StopStrings(["Hello there"])
    assert stop.hold("Hello") == ""  # could begin the stop string: held, not matched
    assert stop.push(" there, friend") == ("", True) and stop.matched == "Hello there"
    inside = StopStrings(["ab"])
    assert inside.hold("xab") == "xab" and inside.push("c") == ("c", False)  # ended before the boundary
