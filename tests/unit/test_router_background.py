"""One background read per backend at a time: the second asked while one runs is not
started; one that ended or was cancelled is forgotten; the router's close cancels the rest."""

from __future__ import annotations

import asyncio

from fleetwarden.router.background import TaskPerBackend


async def test_one_task_per_backend_forgotten_when_it_ends_cancelled_at_close() -> None:
    tasks = TaskPerBackend("context")
    release = asyncio.Event()
    ran: list[str] = []

    async def read(backend: str) -> None:
        ran.append(backend)
        await release.wait()

    assert tasks.start("a", read("a")) and tasks.start("b", read("b"))
    second = read("a")
    assert not tasks.start("a", second)  # closed unrun: no "never awaited" warning
    assert second.cr_frame is None
    await asyncio.sleep(0)
    assert ran == ["a", "b"] and "a" in tasks
    (running,) = [t for t in asyncio.all_tasks() if t.get_name() == "context:a"]
    release.set()
    await running
    await asyncio.sleep(0)  # its done callback
    assert "a" not in tasks and "b" not in tasks
    assert tasks.start("a", read("a"))  # asked again once the first ended
    release.clear()
    await asyncio.sleep(0)
    (again,) = [t for t in asyncio.all_tasks() if t.get_name() == "context:a"]
    tasks.cancel_all()
    assert "a" not in tasks
    await asyncio.gather(again, return_exceptions=True)
    assert again.cancelled()


async def test_one_backends_task_cancelled_leaves_the_others_and_may_start_again() -> None:
    """A new process on a backend: what its read under way would learn is the old one's."""
    tasks = TaskPerBackend("context")
    release = asyncio.Event()

    async def read() -> None:
        await release.wait()

    assert tasks.start("a", read()) and tasks.start("b", read())
    await asyncio.sleep(0)
    (old,) = [t for t in asyncio.all_tasks() if t.get_name() == "context:a"]
    tasks.cancel("a")
    tasks.cancel("c")  # none runs: nothing to do
    assert "a" not in tasks and "b" in tasks
    assert tasks.start("a", read())  # at once, beside the cancelled one still ending
    await asyncio.gather(old, return_exceptions=True)
    assert old.cancelled() and "a" in tasks  # its end forgets only itself
    rest = [t for t in asyncio.all_tasks() if t.get_name().startswith("context:")]
    tasks.cancel_all()
    await asyncio.gather(*rest, return_exceptions=True)
