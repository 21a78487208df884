"""Reading a KV bucket's history and keys on a real NATS. nats-py's own ``history``/``keys`` watch
the bucket and can report "no more entries" before handling the ones already delivered, so on a busy
machine they answer empty (seen once in CI, on ``fleet policy rollback``; not reproduced on demand);
these reads go to the stream and are complete whenever they are asked."""

from __future__ import annotations

import asyncio
import uuid

from fleet.natsconn import connect, key_value, kv_history, kv_keys


async def test_history_lists_every_kept_value_oldest_first_without_deletions(nats_url: str) -> None:
    client = await connect(nats_url, "kv-reads")
    try:
        bucket = await key_value(client, f"kv-reads-{uuid.uuid4().hex[:8]}", history=3)
        assert await kv_history(bucket, "k") == []
        revisions = [await bucket.put("k", f"v{i}".encode()) for i in range(5)]
        await bucket.put("other", b"x")
        assert await kv_history(bucket, "k") == [(r, f"v{i}".encode()) for i, r in enumerate(revisions)][-3:]
        await bucket.delete("k")
        assert [value for _, value in await kv_history(bucket, "k")] == [
            b"v3",
            b"v4",
        ]  # the deletion kept, not listed
    finally:
        await client.close()


async def test_keys_leave_out_deleted_and_purged_keys(nats_url: str) -> None:
    client = await connect(nats_url, "kv-reads")
    try:
        bucket = await key_value(client, f"kv-reads-{uuid.uuid4().hex[:8]}")
        assert await kv_keys(bucket) == []
        for key in ("b", "a", "gone", "purged", "c.d"):
            await bucket.put(key, b"1")
        await bucket.delete("gone")
        await bucket.purge("purged")
        assert await kv_keys(bucket) == ["a", "b", "c.d"]
    finally:
        await client.close()


async def test_concurrent_readers_each_get_the_whole_history(nats_url: str) -> None:
    client = await connect(nats_url, "kv-reads")
    try:
        bucket = await key_value(client, f"kv-reads-{uuid.uuid4().hex[:8]}", history=16)
        for i in range(16):
            await bucket.put("bundle", str(i).encode())
        answers = await asyncio.gather(*(kv_history(bucket, "bundle") for _ in range(64)))
        assert {len(answer) for answer in answers} == {16}
        keys = await asyncio.gather(*(kv_keys(bucket) for _ in range(64)))
        assert all(answer == ["bundle"] for answer in keys)
    finally:
        await client.close()
