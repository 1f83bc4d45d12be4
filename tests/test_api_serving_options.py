"""``--chat-template NAME|FILE`` and ``--alias NAME``: what the served template and names become."""

from __future__ import annotations

import argparse
from pathlib import Path

import httpx
import pytest

from skippy.api.app import ChainService, create_app
from skippy.api.lanes import LanePool
from skippy.commands.api_options import add_api_options, api_settings
from skippy.driver.generator import Generator
from skippy.net.address import Address

TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "


def test_a_chat_template_file_is_served_and_a_bad_one_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    path = tmp_path / "mine.jinja"
    path.write_text(TEMPLATE)
    generator = Generator.from_model(tiny_llama, chat_template=str(path))
    try:
        assert generator.chat_template_choice.origin == "given" and str(path) in generator.chat_template_choice.describe()
        assert generator.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi\n[assistant] "
    finally:
        generator.close()
    with pytest.raises(ValueError, match="cannot read chat template file"):
        Generator.from_model(tiny_llama, chat_template=str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="unknown chat template"):
        Generator.from_model(tiny_llama, chat_template="no-such-name")


def test_the_options_reach_serve_api() -> None:
    parser = argparse.ArgumentParser()
    add_api_options(parser)
    settings = api_settings(parser.parse_args(["--chat-template", "chatml", "--alias", "gpt-4o", "--alias", "local",
                                               "--reasoning-format", "none"]))
    assert (settings["chat_template"], settings["aliases"], settings["reasoning_format"]) == \
        ("chatml", ("gpt-4o", "local"), "none")


async def test_aliases_are_listed_and_accepted(tiny_llama: Path) -> None:
    generator = Generator.from_model(tiny_llama, n_ctx=512)
    try:
        pool = LanePool(Address("127.0.0.1", 9), max_lanes=1, connect_timeout=0.5)
        app = create_app(ChainService(generator, pool, "tiny", aliases=("gpt-4o", "tiny")))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://skippy") as http:
            listed = [model["id"] for model in (await http.get("/v1/models")).json()["data"]]
            one = await http.get("/v1/models/gpt-4o")
            aliased = await http.post("/v1/chat/completions", json={
                "model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
            unknown = await http.post("/v1/chat/completions", json={
                "model": "claude", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    finally:
        generator.close()
    assert listed == ["tiny", "gpt-4o"] and one.status_code == 200
    assert aliased.status_code == 503, aliased.text  # validated, then no chain
    assert unknown.status_code == 404
