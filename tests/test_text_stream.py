"""TextReleaser: UTF-8 safe deltas and stop strings that never leak."""

from __future__ import annotations

from gateway.decoding.text_stream import TextReleaser


def feed_bytes(releaser: TextReleaser, chunks: list[bytes]) -> list[str]:
    return [releaser.feed(chunk) for chunk in chunks] + [releaser.finish()]


def test_split_multibyte_characters_wait_for_their_rest():
    data = "a🎉b我".encode()
    releaser = TextReleaser()
    deltas = feed_bytes(releaser, [data[i:i + 1] for i in range(len(data))])
    assert "".join(deltas) == "a🎉b我"
    assert all("\ufffd" not in d for d in deltas)


def test_mid_character_flag():
    releaser = TextReleaser()
    releaser.feed("🎉".encode()[:2])
    assert releaser.mid_character
    releaser.feed("🎉".encode()[2:])
    assert not releaser.mid_character


def test_stop_string_split_across_pieces_is_never_shown():
    releaser = TextReleaser(("END",))
    deltas = feed_bytes(releaser, [b"hello E", b"N", b"D and more"])
    assert "".join(deltas) == "hello "
    assert releaser.stopped and releaser.text == "hello "


def test_held_back_prefix_is_released_when_it_stops_matching():
    releaser = TextReleaser(("END",))
    assert releaser.feed(b"hi E") == "hi "
    assert releaser.feed(b"x") == "Ex"
    assert releaser.finish() == ""


def test_earliest_of_several_stops_wins():
    releaser = TextReleaser(("cd", "b"))
    assert "".join(feed_bytes(releaser, [b"abcd"])) == "a"
