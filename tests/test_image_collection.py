"""Images no message shows any more are deleted, on SQLite and PostgreSQL: which message shows
which image is recorded as messages are stored, copied by a fork, dropped with the messages; an
image a turn used lately is kept (a turn stores its images before its messages), and a
collected image's number is never given to another. Migration 0010 records what earlier rows
show."""

from __future__ import annotations

from datetime import timedelta

from agentkv.store import NewMessage, Registry
from agentkv.store.images import NewImage
from tests.test_migrations import fetch, migrate

NOW = timedelta(0)  # (no grace: whatever no message shows goes)


def image(n: int) -> NewImage:
    return NewImage(bytes([n]) * 16, "image/png", 8, 8)


def showing(*numbers: int) -> NewMessage:
    parts = [{"type": "text", "text": "look"}]
    parts += [{"type": "image", "image": n} for n in numbers]
    return NewMessage("user", "look", parts=parts)


async def test_an_image_goes_when_no_message_shows_it(registry_url: str) -> None:
    async with await Registry.open(registry_url) as registry:
        x, y, z = await registry.images.add([image(1), image(2), image(3)])
        for agent in ("a", "b"):
            await registry.create_agent(agent)
        await registry.append_messages("a", [showing(x, y), showing(x)])
        await registry.append_messages("b", [showing(y)])
        await registry.fork_agent("a", "c")  # shows x and y too

        await registry.delete_agent("a")
        assert await registry.images.collect(NOW) == 1  # z: stored, never shown
        await registry.delete_agent("c")
        assert set(await registry.images.data([x, y, z])) == {x, y}  # x: used lately, kept
        assert await registry.images.collect() == 0  # (within the grace)
        assert await registry.images.collect(NOW) == 1
        assert set(await registry.images.data([x, y, z])) == {y}

        # b's turn replaced by one without its image: y goes too.
        await registry.append_messages("b", [NewMessage("user", "text")], replace_from=0)
        assert await registry.images.collect(NOW) == 1
        assert await registry.images.data([x, y, z]) == {}

        # The same bytes again: stored again, under a number never used before.
        (again,) = await registry.images.add([image(1)])
        assert again not in (x, y, z)
        await registry.append_messages("b", [showing(again)])
        assert await registry.images.collect(NOW) == 0
        assert (await registry.transcript("b"))[-1].parts[1] == {"type": "image", "image": again}


async def test_showing_an_image_again_keeps_it_past_an_earlier_deletion(
    registry_url: str,
) -> None:
    async with await Registry.open(registry_url) as registry:
        await registry.create_agent("a")
        (x,) = await registry.images.add([image(1)])
        await registry.append_messages("a", [showing(x)])
        await registry.append_messages("a", [NewMessage("user", "text")], replace_from=0)
        # A turn stores the image again (the same bytes: the same number) before its message.
        assert await registry.images.add([image(1)]) == [x]
        assert await registry.images.collect() == 0  # used lately: kept for the turn
        await registry.append_messages("a", [showing(x)])
        assert await registry.images.collect(NOW) == 0


async def test_0010_records_the_images_earlier_messages_show(registry_url: str) -> None:
    await migrate(registry_url, "0009")
    postgres = registry_url.startswith("postgresql")
    blob = "decode('00', 'hex')" if postgres else "X'00'"
    at = "'2026-01-02 03:04:05+00'" if postgres else "'2026-01-02 03:04:05.000000'"
    await fetch(
        registry_url,
        f"INSERT INTO agents (id, name, sampling, created_at, updated_at, version) "
        f"VALUES ('a', 'a', '{{}}', {at}, {at}, 1)",
    )
    for n in (1, 2, 3):
        await fetch(
            registry_url,
            f"INSERT INTO images (id, sha256, media_type, data, width, height, created_at) "
            f"VALUES ({n}, '{n:064d}', 'image/png', {blob}, 8, 8, {at})",
        )
    parts = '[{"type": "text", "text": "x"}, {"type": "image", "image": 1}, '
    parts += '{"type": "image", "image": 2}, {"type": "image", "image": 1}]'
    await fetch(
        registry_url,
        "INSERT INTO messages (agent_id, position, role, content, created_at, parts) "
        f"VALUES ('a', 0, 'user', 'x', {at}, '{parts}')",
    )
    async with await Registry.open(registry_url) as registry:  # (upgrades to 0010)
        assert await registry.images.collect(NOW) == 1  # 3: no message shows it
        assert set(await registry.images.data([1, 2, 3])) == {1, 2}
    shown = await fetch(registry_url, "SELECT image_id FROM message_images ORDER BY image_id")
    assert [tuple(r) for r in shown] == [(1,), (2,)]
