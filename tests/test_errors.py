"""OpenAI's `param` from pydantic's error locations: always the field a client sent."""

from __future__ import annotations

import pytest

from gateway.wire.errors import param_of


@pytest.mark.parametrize(("location", "param"), [
    (("body", "messages", 0, "content"), "messages[0].content"),
    (("messages", 0, "content", "str"), "messages[0].content"),  # pydantic's union member is no field
    (("messages", 1, "content", "list[TextPart]", 0, "type"), "messages[1].content[0].type"),
    (("routing", "threshold"), "routing.threshold"),
    (("",), ""),  # an unknown key that is the empty string is still named
    (("\u00c7,dlQ",), "\u00c7,dlQ"),  # a first name is a field even if it looks like a type (found by the fuzz)
    ((), None),
])
def test_param_names_the_field_the_client_sent(location, param):
    assert param_of(location) == param


def test_an_unknown_key_that_looks_like_a_type_is_still_named():
    assert param_of(("messages", 0, "Extra"), last_is_field=True) == "messages[0].Extra"
    assert param_of(("messages", 0, "content", "Extra")) == "messages[0].content"
