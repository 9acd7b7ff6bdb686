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
